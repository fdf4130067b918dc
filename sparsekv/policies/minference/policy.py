"""MInference (vertical-slash) sparse prefill: a compute policy, prefill only.

Per head, the last `last_q` queries of the chunk estimate which key columns ("vertical" lines: sinks,
delimiters) and which diagonals ("slash" lines: fixed relative offsets q_pos - k_pos, the local band) carry
the attention mass; every query of the chunk then attends exactly to the union of the top `vertical_size`
columns and the top `slash_size` diagonals (plus the first `sink_tokens` columns and the `recent_diagonals`
offsets next to the main diagonal, always kept), through vertical_slash_attention (vertical_slash.py beside this file).
Decode is not sparse: the factory pairs this policy with `full` for decode.

`slash_granularity` = 64 (the default) ranks whole bands of 64 offsets [64 b, 64 b + 63] by their summed diagonal
mass and keeps the top ceil(slash_size / 64) bands (the bands holding the recent diagonals forced in). The kernel's
cost is a key tile per query block and touched run of offsets: per-diagonal picks (granularity 1, MInference's own)
scatter over hundreds of bands, band picks touch exactly the budget's bands, each one contiguous run that the kernel
masks with two comparisons instead of selection bits.

offload=none (compute_prefill): all keys are on the device, so the selection is MInference's own: softmax of
the last-q scores over every key they may see, column sums and diagonal sums, top-k of each, computed by the fused
kernels of sparsekv.policies.minference.vertical_slash_estimate (the scores are never materialised). With
`whole_prompt_prefill` (the default) the engine prefills each prompt in one step, so the last-q rows are the
prompt's own last ones, as MInference estimates them; in chunks each chunk's pattern comes from its own last
rows, inside the context, and a chunk before the prompt's last keeps early_chunk_budget_scale times the budgets. With
`slash_excludes_vertical` the diagonal sums leave out the selected columns: a column read by the last-q rows
otherwise adds its mass to the last_q diagonals it crosses, and those diagonals, each costing a key tile per query
block, win slash budget for mass the column already keeps.

offload=cpu (compute_chunked_prefill) with the prefix resident on the device
----------------------------------------------------------------------------
When the GPU block cache holds every prefix block in one run of consecutive slots and the chunk was written into
the slots right after it (ctx.sequence_kv; the usual case when the cache can hold the prompt), the prefix and the
chunk are one device view and the chunk is computed exactly as offload=none computes it: compute_prefill on the
view. When the cache holds the prefix in one run but the chunk could not follow it (reader.resident covers every
prefix block, yet no sequence_kv: e.g. a batch prefill whose sequences' blocks interleave in the cache), the two
pieces are combined instead: the last-q rows' exact log-sum-exp merged from the prefix and the chunk, the masses of
both pieces under it (one [H, c0 + n] column and diagonal estimate), offload=none's selection, one attention call
on the prefix and one on the chunk's own keys, merged. Either way the pattern and the result are offload=none's, and
the work per chunk is a fixed set of kernels whatever the number of prefix blocks (streaming, below, makes an
estimate, two top-k, two compactions, an index and an attention call per group of half the ring).

offload=cpu (compute_chunked_prefill), one pass over the host blocks
---------------------------------------------------------------------
Otherwise (no cache, or a prefix it holds only in part) the prefix keys arrive group by group through the KVReader
(reader.groups: groups of ring_capacity / 2 consecutive blocks, one attention call each; a leading run of blocks
the cache holds is one more group, the oldest), each block exactly once, and a group's attention must be computed
while it is in its GPU slots, i.e. before the older groups have been seen. The global top-k cannot be known at
that time, so the selection is made online, one group at a time (below, "candidate" is a column, or a granule of
slash_granularity offsets: a diagonal or a band):

* Normaliser. The last-q scores of a streamed group are normalised by the softmax over the chunk's own keys
  (log-sum-exp lse_local per last-q row, known before streaming), not by the final one, which needs every
  block: the fused masses kernel takes lse_local in place of its own row statistics. Every candidate is weighed
  with the same per-row weights, so candidates stay comparable across groups; the ranking differs from the exact
  one only through the per-row factor exp(lse_local - lse_final), which is nearly constant over the adjacent
  last-q rows. A probability exp(s - lse_local) is capped at 2^100 (prefix keys more than 69 nats heavier than
  the local ones tie at the cap) so that masses stay finite in fp32.
* Order. Groups are streamed newest first (the blocks of a group in position order). The last-q evidence for
  diagonal d lies at keys near c0 + n - 1 - d, the newest end of the keys that diagonal touches for the chunk's
  queries; streaming newest first delivers each diagonal's evidence before (or together with) every group in
  which it is used.
* Columns. A running top-V of the column masses seen so far (the chunk's own columns are seen first): a
  column of a streamed group is kept iff its mass reaches the V-th largest mass seen so far, this group
  included. Every column of the global top-V (under the lse_local normaliser) is kept, since the running
  threshold never exceeds the final one; a few more may be, so the column set is a superset of the global one.
* Diagonals. The same with a running top-S over the granules whose evidence is complete, joined for each group
  by the granules whose evidence has started: a granule is used for a group iff it is in that running top-S,
  so a granule of the global top-S is used wherever its evidence is complete; a granule whose evidence straddles
  two groups is ranked on its partial mass for the first of them; a granule chosen early may be displaced later
  by heavier ones and then not be used for the older groups.
* The chunk's own keys stay on the device, so their part (causal attention of the chunk to itself) is computed
  last, with the final thresholds (the global top-V / top-S under the lse_local normaliser).
Each group's and the chunk's partial (o, lse) are merged with merge_attention_outputs. With budgets that
cover every key (vertical_size and slash_size >= keys) every threshold stays -inf until all candidates are in,
so every key is kept and the result is dense attention (exact). Groups of several blocks see more evidence
before their selection than single blocks did; per group the work is a fixed handful of kernels (masses, two
top-k, two compactions, the attention), independent of the group's size.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch

from sparsekv.kernels import merge_attention_outputs
from sparsekv.policies.minference.vertical_slash import vertical_slash_attention, visible_pair_count
from sparsekv.policies.minference.selection import (SENTINEL, add_to_granules, band_offsets, band_sums, compact,
                                                    kth_value, offsets_kept, top_indices, top_values)
from sparsekv.policies.minference.vertical_slash_estimate import (check_estimate_rows, last_rows_lse,
                                                                vertical_slash_masses)
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.context import KVLayout, KVReader, PolicyContext

SLASH_BAND = 64  # offsets per band when slash_granularity > 1
_INF = float("inf")


@dataclass
class MInferencePolicy(SparsePolicy):
    """Vertical-slash sparse prefill (MInference). Changes computation only, loads every block."""
    name: str = "minference"
    last_q: int = 64  # queries at the end of the chunk that estimate the pattern
    # the smallest budgets within 2 points of full at 32K on the probe where the last_q rows are the prompt's own
    # last ones (docs/benchmarks.md, "Policies judged on the probe")
    vertical_size: int = 250  # key columns kept per head
    slash_size: int = 1500  # diagonals kept per head
    adaptive_budget: Optional[float] = None  # if set: both budgets = this fraction of the keys the chunk sees
    # a prefill chunk that does not end its prompt (offloaded prefill; whole_prompt_prefill=false) estimates its
    # pattern from rows inside the context, which miss more of what the question will need: its budgets are this
    # multiple of the two above (the prompt's last chunk keeps them). 1: one budget for every chunk. Offloaded on the
    # probe at 32K, 2 keeps the rule where 1 loses 2.5 points (docs/benchmarks.md)
    early_chunk_budget_scale: float = 2.0
    sink_tokens: int = 30  # always-kept columns at the start of the sequence
    recent_diagonals: int = 100  # always-kept diagonals next to the main one (offsets 0..recent-1)
    # offload=none: rank the diagonals by the mass the selected columns leave (a strong column otherwise also lifts
    # the last_q diagonals it crosses, and the slash budget goes to mass that is already kept). Off by default: a
    # second estimate pass, measured slower end to end at 128K on structured dummy weights (docs/benchmarks.md)
    slash_excludes_vertical: bool = False
    # SLASH_BAND (64): rank whole 64-offset bands; 1: rank single diagonals (MInference's own). Bands score within
    # a point of full attention on the probe at 32K and prefill 128K in two thirds of the time (docs/decisions.md)
    slash_granularity: int = SLASH_BAND
    # offload=none: prefill each prompt in one step, so the last_q queries are the prompt's last ones (the question)
    # rather than each 8K chunk's; at 32K on the probe's earlier checkpoint 82.5 against 78.3 with chunks, full 83.3,
    # and 128K prefill 14% faster (docs/benchmarks.md). false: scheduler.max_num_batched_tokens chunks (less
    # activation memory)
    whole_prompt_prefill: bool = True

    supports_prefill: ClassVar[bool] = True
    supports_decode: ClassVar[bool] = False
    requires_block_selection: ClassVar[bool] = False
    # When the budgets cover every key the chunk sees (short prompts with the default budgets), the selection
    # is all keys: run the dense pipeline of the base class instead, which gives the same result faster.
    dense_when_all_kept: ClassVar[bool] = True

    def __post_init__(self) -> None:
        def whole(field: str, minimum: int) -> None:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"policy.{field}={value!r}: must be an integer >= {minimum}")

        whole("last_q", 1)
        whole("vertical_size", 0)
        whole("slash_size", 0)
        whole("sink_tokens", 0)
        whole("recent_diagonals", 0)
        granularity = self.slash_granularity
        if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity not in (1, SLASH_BAND):
            raise ValueError(f"policy.slash_granularity={self.slash_granularity!r}: must be 1 (single diagonals) or "
                             f"{SLASH_BAND} (whole {SLASH_BAND}-offset bands)")
        for flag in ("slash_excludes_vertical", "whole_prompt_prefill"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"policy.{flag}={getattr(self, flag)!r}: must be true or false")
        scale = self.early_chunk_budget_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 1.0 <= scale < _INF:
            raise ValueError(f"policy.early_chunk_budget_scale={scale!r}: must be a number >= 1 (1: the same budgets "
                             "for every prefill chunk)")
        budget = self.adaptive_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 < budget <= 1.0 \
                    or math.isnan(budget):
                raise ValueError(f"policy.adaptive_budget={budget!r}: must be a fraction in (0, 1] or null")

    def check_layout(self, layout: KVLayout) -> None:
        check_estimate_rows(self.last_q, layout.head_dim, layout.dtype, layout.device, "policy.last_q")

    def initialize(self, layout: KVLayout) -> None:
        self.check_layout(layout)

    def budgets(self, num_keys: int, ends_prompt: bool = True) -> tuple[int, int]:
        """(columns, diagonals) kept per head when the chunk sees num_keys keys; forced ones included. A chunk that
        does not end its prompt keeps early_chunk_budget_scale times more."""
        if self.adaptive_budget is not None:
            vertical = slash = math.ceil(self.adaptive_budget * num_keys)
        else:
            vertical, slash = self.vertical_size, self.slash_size
        if not ends_prompt:
            vertical, slash = (math.ceil(budget * self.early_chunk_budget_scale) for budget in (vertical, slash))
        vertical = min(max(vertical, min(self.sink_tokens, num_keys)), num_keys)
        slash = min(max(slash, min(self.recent_diagonals, num_keys)), num_keys)
        return vertical, slash

    # ------------------------------------------------------------------------------------ offload=none
    def compute_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                        softmax_scale: float) -> torch.Tensor:
        """q [n, H, D] are the last n positions of k/v [S, KVH, D] -> [n, H, D]. With whole_prompt_prefill each call
        ends its prompt; without, the resident store does not say which chunk does, so every chunk keeps the early
        chunks' budgets."""
        return self._prefill(q, k, v, layer_id, softmax_scale, ends_prompt=self.whole_prompt_prefill)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, softmax_scale: float,
                 ends_prompt: bool) -> torch.Tensor:
        n, H, _ = q.shape
        S = k.shape[0]
        if n == 0:
            return torch.empty_like(q)
        if self.dense_when_all_kept and self.budgets(S, ends_prompt) == (S, S):
            visible = H * visible_pair_count(n, S, S - n)
            self.record_density(visible, visible)
            return super().compute_prefill(q, k, v, layer_id, softmax_scale)
        vertical_idx, slash_offsets = self.estimate_pattern(q, k, softmax_scale, ends_prompt)
        pairs = torch.zeros(1, dtype=torch.int64, device=q.device)  # computed pairs, counted by the kernel
        out, _ = vertical_slash_attention(q, k, v, vertical_idx, slash_offsets, softmax_scale, S - n, pairs)
        self.record_density(pairs, H * visible_pair_count(n, S, S - n))
        return out

    def estimate_pattern(self, q: torch.Tensor, k: torch.Tensor, softmax_scale: float, ends_prompt: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """MInference's estimate: q [n, H, D] are the last n of the S keys k [S, KVH, D].

        Returns (vertical_idx [H, V], slash_offsets [H, NS]) sorted int32: the top columns by softmax mass of
        the last `last_q` queries (sinks forced in) and the top offsets q_pos - k_pos by diagonal mass (recent
        offsets forced in); with slash_granularity 64 the offsets of the top bands (NS rounded up to whole
        bands; offsets past the keys are out of range, which the kernel ignores)."""
        L = min(self.last_q, q.shape[0])
        col, diag = vertical_slash_masses(q[-L:], k, softmax_scale)  # [H, S] each: offsets 0 .. S-1

        def diag_without(cols: torch.Tensor) -> torch.Tensor:
            return vertical_slash_masses(q[-L:], k, softmax_scale, exclude_columns=cols)[1]

        return self.select_pattern(col, diag, *self.budgets(k.shape[0], ends_prompt), diag_without)

    def select_pattern(self, col: torch.Tensor, diag: torch.Tensor, V: int, NS: int,
                       diag_without: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """estimate_pattern's choice from the masses col [H, S] and diag [H, S] (offsets 0 .. S-1), modified in place;
        diag_without(vertical_idx) gives the diagonal masses without those columns (slash_excludes_vertical)."""
        col[:, :self.sink_tokens] = _INF
        vertical_idx = top_indices(col, V).sort(dim=1).values.to(torch.int32)
        if self.slash_excludes_vertical and V > 0:
            diag = diag_without(vertical_idx)
        if self.slash_granularity == 1:
            diag[:, :self.recent_diagonals] = _INF
            return vertical_idx, top_indices(diag, NS).sort(dim=1).values.to(torch.int32)
        band = self.slash_granularity
        sums = band_sums(diag, band)  # [H, NB]
        sums[:, :-(-self.recent_diagonals // band)] = _INF
        bands = torch.topk(sums, min(-(-NS // band), sums.shape[1]), dim=1).indices.sort(dim=1).values
        return vertical_idx, band_offsets(bands, band)

    # ------------------------------------------------------------------------------------- offload=cpu
    def compute_chunked_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PolicyContext,
                                reader: KVReader) -> torch.Tensor:
        """q [n, H, D], k/v [n, KVH, D] of this chunk -> [n, H, D]: compute_prefill on ctx.sequence_kv when the store
        gives it; else the prefix is read in place when the GPU block cache holds it in one run, else streamed once
        (module docstring)."""
        if ctx.sequence_kv is not None:
            k_all, v_all = ctx.sequence_kv  # [kv_len, KVH, D]: the prefix, then this chunk
            return self._prefill(q, k_all, v_all, ctx.layer, ctx.softmax_scale, ctx.ends_prompt)
        n, H, _ = q.shape
        if n == 0:
            return torch.empty_like(q)
        blocks = list(ctx.candidates)
        bs, softmax_scale = reader.block_size, ctx.softmax_scale
        c0 = len(blocks) * bs  # prefix tokens: the chunk's queries sit at c0 .. c0+n-1
        T = c0 + n
        V, NS = self.budgets(T, ctx.ends_prompt)
        if self.dense_when_all_kept and (V, NS) == (T, T):
            visible = H * (n * c0 + visible_pair_count(n, n, 0))
            self.record_density(visible, visible)
            return super().compute_chunked_prefill(q, k, v, ctx, reader)
        cached = reader.resident(blocks) if blocks else None  # the oldest blocks, when the cache holds them
        if cached is not None and len(cached.ids) == len(blocks):
            return self._prefill_after_resident_prefix(q, k, v, cached.k, cached.v, softmax_scale, (V, NS))
        num_cached = 0 if cached is None else len(cached.ids)
        L = min(self.last_q, n)
        r0 = c0 + n - L  # absolute position of the first last-q row
        ql = q[-L:]
        g = self.slash_granularity
        NG, NSg = -(-T // g), -(-NS // g)  # granules (offsets or bands) in all, and kept

        # chunk-local statistics (chunk-relative positions: rows n-L.., keys 0..n-1; offsets are absolute)
        lse_loc = last_rows_lse(ql, k, softmax_scale, n - L)  # [H, L], the fixed normaliser
        col_loc, diag_loc = vertical_slash_masses(ql, k, softmax_scale, n - L, lse=lse_loc)  # [H, n] each
        col_loc[:, :max(0, self.sink_tokens - c0)] = _INF
        slash_m = torch.zeros((H, NG), dtype=torch.float32, device=q.device)  # mass per granule of offsets
        add_to_granules(slash_m, diag_loc, 0, g)
        slash_m[:, :-(-self.recent_diagonals // g)] = _INF

        def finished(fin: int) -> int:  # granules whose offsets are all <= fin
            return NG if fin >= T - 1 else (fin + 1) // g

        col_top = top_values(col_loc, V)  # running top-V column masses
        fg = finished(n - L if blocks else n - 1)  # offsets <= n - L have all their evidence in the chunk
        slash_top = top_values(slash_m[:, :fg], NSg)  # running top-NSg over finished granules

        out = lse = None
        pairs = torch.zeros(1, dtype=torch.int64, device=q.device)  # computed pairs, counted by the kernels
        size = max(1, reader.ring_capacity // 2)
        ends = list(range(len(blocks), num_cached, -size))  # groups of consecutive blocks, newest first
        order = [b for end in ends for b in blocks[max(num_cached, end - size):end]]
        groups = ((group.k, group.v, end) for group, end in zip(reader.groups(order, group_size=size), ends))
        if cached is not None:  # the cached run is the oldest group
            groups = itertools.chain(groups, [(cached.k, cached.v, num_cached)])
        for k_grp, v_grp, end in groups:  # k/v [W, KVH, D]
            W = k_grp.shape[0]
            a = end * bs - W  # position of the group's first key
            # (i) last-q evidence of this group: offsets d0 .. r0 - a + L - 1
            d0 = r0 - a - W + 1
            col_g, diag_g = vertical_slash_masses(ql, k_grp, softmax_scale, r0 - a, lse=lse_loc, offsets_from=d0)
            col_g[:, :max(0, self.sink_tokens - a)] = _INF
            add_to_granules(slash_m, diag_g, d0, g)
            col_top = top_values(torch.cat([col_top, col_g], dim=1), V)
            seen = (r0 - a + L - 1) // g + 1  # granules with evidence so far
            slash_thr = kth_value(top_values(torch.cat([slash_top, slash_m[:, fg:seen]], dim=1), NSg), NSg)
            new_fg = finished(r0 - a)  # evidence of offsets <= r0 - a lies at keys >= a: complete now
            slash_top = top_values(torch.cat([slash_top, slash_m[:, fg:new_fg]], dim=1), NSg)
            fg = new_fg
            # (ii) all chunk queries against this group, on the selected columns and diagonals
            e0, e1 = c0 - a - W + 1, c0 + n - a  # offsets chunk queries can have in this group
            vertical_idx = compact(col_g >= kth_value(col_top, V), 0)
            slash_offsets = compact(offsets_kept(slash_m >= slash_thr, e0, e1, g), e0)
            grp_out, grp_lse = vertical_slash_attention(q, k_grp, v_grp, vertical_idx, slash_offsets,
                                                        softmax_scale, c0 - a, pairs)
            out, lse = (grp_out, grp_lse) if out is None else merge_attention_outputs(out, lse, grp_out, grp_lse)

        # the chunk's own keys, with the final thresholds
        slash_top = top_values(torch.cat([slash_top, slash_m[:, fg:]], dim=1), NSg)
        vertical_idx = compact(col_loc >= kth_value(col_top, V), 0)
        slash_offsets = compact(offsets_kept(slash_m >= kth_value(slash_top, NSg), 0, n, g), 0)
        own_out, own_lse = vertical_slash_attention(q, k, v, vertical_idx, slash_offsets, softmax_scale, 0, pairs)
        if out is not None:
            own_out, _ = merge_attention_outputs(out, lse, own_out, own_lse)
        self.record_density(pairs, H * (n * c0 + visible_pair_count(n, n, 0)))
        return own_out

    def _prefill_after_resident_prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre: torch.Tensor,
                                       v_pre: torch.Tensor, softmax_scale: float, budgets: tuple[int, int]
                                       ) -> torch.Tensor:
        """compute_prefill's estimate and attention with the keys in two device pieces, the prefix k_pre/v_pre
        [c0, KVH, D] and the chunk's own k/v [n, KVH, D]: the masses of each piece under the rows' exact
        log-sum-exp (merged from both pieces) make the pattern of all c0 + n keys at once, two attention calls and a
        merge compute it. One fixed set of kernels per chunk, whatever c0 (module docstring)."""
        n, H, _ = q.shape
        c0 = k_pre.shape[0]
        L = min(self.last_q, n)
        ql, r0 = q[-L:], c0 + n - L  # the last-q rows and the position of the first
        lse = torch.logaddexp(last_rows_lse(ql, k_pre, softmax_scale, r0),
                              last_rows_lse(ql, k, softmax_scale, n - L))  # [H, L] over all keys

        def masses(exclude: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
            """col [H, c0 + n] and diag [H, c0 + n] (offsets 0 .. c0 + n - 1) of all keys."""
            col_pre, diag = vertical_slash_masses(ql, k_pre, softmax_scale, r0, exclude_columns=exclude, lse=lse)
            col_own, diag_own = vertical_slash_masses(ql, k, softmax_scale, n - L, lse=lse,
                                                      exclude_columns=None if exclude is None else exclude - c0)
            diag[:, :n] += diag_own
            return torch.cat([col_pre, col_own], dim=1), diag

        vertical_idx, slash_offsets = self.select_pattern(*masses(), *budgets, lambda c: masses(c)[1])
        pairs = torch.zeros(1, dtype=torch.int64, device=q.device)  # computed pairs, counted by the kernels
        out, lse_pre = vertical_slash_attention(q, k_pre, v_pre, vertical_idx, slash_offsets, softmax_scale, c0, pairs)
        own_columns = torch.where(vertical_idx >= c0, vertical_idx - c0, SENTINEL).sort(dim=1).values
        own_out, own_lse = vertical_slash_attention(q, k, v, own_columns, slash_offsets, softmax_scale, 0, pairs)
        out, _ = merge_attention_outputs(out, lse_pre, own_out, own_lse)
        self.record_density(pairs, H * (n * c0 + visible_pair_count(n, n, 0)))
        return out
