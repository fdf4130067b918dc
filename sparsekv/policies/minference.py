"""MInference (vertical-slash) sparse prefill: a compute policy, prefill only.

Per head, the last `last_q` queries of the chunk estimate which key columns ("vertical" lines: sinks,
delimiters) and which diagonals ("slash" lines: fixed relative offsets q_pos - k_pos, the local band) carry
the attention mass; every query of the chunk then attends exactly to the union of the top `vertical_size`
columns and the top `slash_size` diagonals (plus the first `sink_tokens` columns and the `recent_diagonals`
offsets next to the main diagonal, always kept), through sparsekv.kernels.vertical_slash_attention.
Decode is not sparse: the factory pairs this policy with `full` for decode.

offload=none (compute_prefill): all keys are on the device, so the selection is MInference's own: softmax of
the last-q scores over every key they may see, column sums and diagonal sums, top-k of each, computed by the fused
kernels of sparsekv.kernels.vertical_slash_estimate (the scores are never materialised). With
`slash_excludes_vertical` the diagonal sums leave out the selected columns: a column read by the last-q rows
otherwise adds its mass to the last_q diagonals it crosses, and those diagonals, each costing a key tile per query
block, win slash budget for mass the column already keeps.

offload=cpu (compute_chunked_prefill), one pass over the host blocks
---------------------------------------------------------------------
The prefix keys arrive only block by block through OffloadEngine.stream_blocks, each exactly once, and a
block's attention must be computed while it is in its GPU slot, i.e. before the later blocks have been seen.
The global top-k cannot be known at that time, so the selection is made online:

* Normaliser. The last-q scores of a streamed block are normalised by the softmax over the chunk's own keys
  (log-sum-exp lse_local per last-q row, known before streaming), not by the final one, which needs every
  block. Every candidate (column or diagonal) is weighed with the same per-row weights, so candidates stay
  comparable across blocks; the ranking differs from the exact one only through the per-row factor
  exp(lse_local - lse_final), which is nearly constant over the adjacent last-q rows. Masses are kept in log
  space, so prefix keys much heavier than the local ones cannot overflow.
* Order. Blocks are streamed newest first. The last-q evidence for diagonal d lies at keys near c0 + n - 1 - d,
  the newest end of the keys that diagonal touches for the chunk's queries; streaming newest first delivers
  each diagonal's evidence before (or together with) every block in which it is used.
* Columns. A running top-V of the column masses seen so far (the chunk's own columns are seen first): a
  column of a streamed block is kept iff its mass reaches the V-th largest mass seen so far, this block
  included. Every column of the global top-V (under the lse_local normaliser) is kept, since the running
  threshold never exceeds the final one; a few more may be, so the column set is a superset of the global one.
* Diagonals. The same with a running top-S over the diagonals whose evidence has been seen. A diagonal is used
  for a block iff it is in the running top-S at that block, so a diagonal of the global top-S is used wherever
  its evidence is complete; a diagonal whose 64-row evidence straddles two blocks is ranked on its partial
  mass for the first of them; a diagonal chosen early may be displaced later by heavier ones and then not be
  used for the older blocks.
* The chunk's own keys stay on the device, so their part (causal attention of the chunk to itself) is computed
  last, with the final thresholds (the global top-V / top-S under the lse_local normaliser).
Each block's and the chunk's partial (o, lse) are merged with merge_attention_outputs. With budgets that
cover every key (vertical_size and slash_size >= keys) every threshold stays -inf until all candidates are in,
so every key is kept and the result is dense attention (exact).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

import torch

from sparsekv.kernels import merge_attention_outputs
from sparsekv.kernels.vertical_slash_estimate import vertical_slash_masses
from sparsekv.kernels.vertical_slash import (
    vertical_slash_attention,
    vertical_slash_pair_count,
    visible_pair_count,
)
from sparsekv.policies.base import SparsePolicy

if TYPE_CHECKING:
    from sparsekv.engine.sequence import Sequence
    from sparsekv.kvcache.offload_engine import OffloadEngine

_SENTINEL = 1 << 30  # pads ragged per-head index lists (ignored by the kernel: out of range)
_INF = float("inf")


@dataclass
class MInferencePolicy(SparsePolicy):
    """Vertical-slash sparse prefill (MInference). Changes computation only, loads every block."""
    name: str = "minference"
    last_q: int = 64  # queries at the end of the chunk that estimate the pattern
    vertical_size: int = 1000  # key columns kept per head
    slash_size: int = 6096  # diagonals kept per head
    adaptive_budget: Optional[float] = None  # if set: both budgets = this fraction of the keys the chunk sees
    sink_tokens: int = 30  # always-kept columns at the start of the sequence
    recent_diagonals: int = 100  # always-kept diagonals next to the main one (offsets 0..recent-1)
    # offload=none: rank the diagonals by the mass the selected columns leave (a strong column otherwise also lifts
    # the last_q diagonals it crosses, and the slash budget goes to mass that is already kept). Off by default: a
    # second estimate pass, measured slower end to end at 128K on structured dummy weights (docs/benchmarks.md)
    slash_excludes_vertical: bool = False

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
        if not isinstance(self.slash_excludes_vertical, bool):
            raise ValueError(f"policy.slash_excludes_vertical={self.slash_excludes_vertical!r}: must be true or false")
        budget = self.adaptive_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 < budget <= 1.0 \
                    or math.isnan(budget):
                raise ValueError(f"policy.adaptive_budget={budget!r}: must be a fraction in (0, 1] or null")

    def budgets(self, num_keys: int) -> tuple[int, int]:
        """(columns, diagonals) kept per head when the chunk sees num_keys keys; forced ones included."""
        if self.adaptive_budget is not None:
            vertical = slash = math.ceil(self.adaptive_budget * num_keys)
        else:
            vertical, slash = self.vertical_size, self.slash_size
        vertical = min(max(vertical, min(self.sink_tokens, num_keys)), num_keys)
        slash = min(max(slash, min(self.recent_diagonals, num_keys)), num_keys)
        return vertical, slash

    # ------------------------------------------------------------------------------------ offload=none
    def compute_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                        softmax_scale: float) -> torch.Tensor:
        """q [n, H, D] are the last n positions of k/v [S, KVH, D] -> [n, H, D]."""
        n, H, _ = q.shape
        S = k.shape[0]
        if n == 0:
            return torch.empty_like(q)
        if self.dense_when_all_kept and self.budgets(S) == (S, S):
            visible = H * visible_pair_count(n, S, S - n)
            self.record_density(visible, visible)
            return super().compute_prefill(q, k, v, layer_id, softmax_scale)
        vertical_idx, slash_offsets = self.estimate_pattern(q, k, softmax_scale)
        out, _ = vertical_slash_attention(q, k, v, vertical_idx, slash_offsets, softmax_scale, S - n)
        self.record_density(vertical_slash_pair_count(n, S, S - n, vertical_idx, slash_offsets).sum(),
                          H * visible_pair_count(n, S, S - n))
        return out

    def estimate_pattern(self, q: torch.Tensor, k: torch.Tensor, softmax_scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """MInference's estimate: q [n, H, D] are the last n of the S keys k [S, KVH, D].

        Returns (vertical_idx [H, V], slash_offsets [H, NS]) sorted int32: the top columns by softmax mass of
        the last `last_q` queries (sinks forced in) and the top offsets q_pos - k_pos by diagonal mass (recent
        offsets forced in)."""
        L = min(self.last_q, q.shape[0])
        V, NS = self.budgets(k.shape[0])
        col, diag = vertical_slash_masses(q[-L:], k, softmax_scale)  # [H, S] each: offsets 0 .. S-1
        col[:, :self.sink_tokens] = _INF
        vertical_idx = torch.topk(col, V, dim=1).indices.sort(dim=1).values.to(torch.int32)
        if self.slash_excludes_vertical and V > 0:
            _, diag = vertical_slash_masses(q[-L:], k, softmax_scale, exclude_columns=vertical_idx)
        diag[:, :self.recent_diagonals] = _INF
        slash_offsets = torch.topk(diag, NS, dim=1).indices.sort(dim=1).values.to(torch.int32)
        return vertical_idx, slash_offsets

    # ------------------------------------------------------------------------------------- offload=cpu
    def compute_chunked_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                                softmax_scale: float, offload_engine: "OffloadEngine", kvcache_manager,
                                current_chunk_idx: int, seq: "Sequence", num_tokens: int) -> torch.Tensor:
        """q [n, H, D], k/v [n, KVH, D] of this chunk -> [n, H, D]; the prefix streams once (module docstring)."""
        n, H, _ = q.shape
        if n == 0:
            return torch.empty_like(q)
        blocks = list(kvcache_manager.prefix_blocks(seq))
        bs = offload_engine.block_size
        c0 = len(blocks) * bs  # prefix tokens: the chunk's queries sit at c0 .. c0+n-1
        T = c0 + n
        V, NS = self.budgets(T)
        if self.dense_when_all_kept and (V, NS) == (T, T):
            visible = H * (n * c0 + visible_pair_count(n, n, 0))
            self.record_density(visible, visible)
            return super().compute_chunked_prefill(q, k, v, layer_id, softmax_scale, offload_engine,
                                                   kvcache_manager, current_chunk_idx, seq, num_tokens)
        L = min(self.last_q, n)
        r0 = c0 + n - L  # absolute position of the first last-q row
        ql = q[-L:]
        dev = q.device

        # chunk-local statistics (chunk-relative positions: rows n-L.., keys 0..n-1)
        s_loc = _scores(ql, k, softmax_scale)  # [H, L, n]
        causal = torch.arange(n, device=dev)[None, :] > (n - L) + torch.arange(L, device=dev)[:, None]
        s_loc = s_loc.masked_fill(causal, -_INF)
        lse_loc = torch.logsumexp(s_loc, dim=-1)  # [H, L], the fixed normaliser
        col_loc, diag_loc, d_first = _log_masses(s_loc, lse_loc, n - L, 0)
        col_loc[:, :max(0, self.sink_tokens - c0)] = _INF
        slash_lm = torch.full((H, T), -_INF, dtype=torch.float32, device=dev)  # log mass per offset 0..T-1
        slash_lm[:, :n] = diag_loc[:, -d_first:]
        slash_lm[:, :self.recent_diagonals] = _INF

        col_top = _top_values(col_loc, V)  # running top-V column masses
        fin = n - L if blocks else n - 1  # offsets <= fin have all their evidence
        slash_top = _top_values(slash_lm[:, :fin + 1], NS)  # running top-NS over finished offsets

        out = lse = None
        pairs = torch.zeros((), dtype=torch.int64, device=dev)
        newest_first = blocks[::-1]
        for i, (slot, _) in enumerate(offload_engine.stream_blocks(layer_id, newest_first)):
            a = (len(blocks) - 1 - i) * bs  # position of the block's first key
            k_blk, v_blk = offload_engine.get_kv_for_slot(slot)
            # (i) last-q evidence of this block: rows at r0 - a .. relative to the block, every key visible
            col_b, diag_b, d0 = _log_masses(_scores(ql, k_blk, softmax_scale), lse_loc, r0 - a, 0)
            col_b[:, :max(0, self.sink_tokens - a)] = _INF
            d1 = d0 + diag_b.shape[1]  # offsets d0 .. d1-1 gain evidence
            slash_lm[:, d0:d1] = torch.logaddexp(slash_lm[:, d0:d1], diag_b)
            col_top = _top_values(torch.cat([col_top, col_b], dim=1), V)
            col_thr = _kth(col_top, V)
            slash_thr = _kth(_top_values(torch.cat([slash_top, slash_lm[:, fin + 1:d1]], dim=1), NS), NS)
            new_fin = r0 - a  # evidence of offsets <= r0 - a lies at keys >= a: complete now
            slash_top = _top_values(torch.cat([slash_top, slash_lm[:, fin + 1:new_fin + 1]], dim=1), NS)
            fin = new_fin
            # (ii) all chunk queries against this block, on the selected columns and diagonals
            e0, e1 = c0 - a - bs + 1, c0 + n - a  # offsets chunk queries can have in this block
            vertical_idx = _sorted_selection(col_b >= col_thr, 0)
            slash_offsets = _sorted_selection(slash_lm[:, e0:e1] >= slash_thr, e0)
            blk_out, blk_lse = vertical_slash_attention(q, k_blk, v_blk, vertical_idx, slash_offsets,
                                                        softmax_scale, c0 - a)
            offload_engine.record_slot_compute_done(slot)
            pairs = pairs + vertical_slash_pair_count(n, bs, c0 - a, vertical_idx, slash_offsets).sum()
            out, lse = (blk_out, blk_lse) if out is None else merge_attention_outputs(out, lse, blk_out, blk_lse)

        # the chunk's own keys, with the final thresholds
        slash_top = _top_values(torch.cat([slash_top, slash_lm[:, fin + 1:]], dim=1), NS)
        vertical_idx = _sorted_selection(col_loc >= _kth(col_top, V), 0)
        slash_offsets = _sorted_selection(slash_lm[:, :n] >= _kth(slash_top, NS), 0)
        own_out, own_lse = vertical_slash_attention(q, k, v, vertical_idx, slash_offsets, softmax_scale, 0)
        pairs = pairs + vertical_slash_pair_count(n, n, 0, vertical_idx, slash_offsets).sum()
        if out is not None:
            own_out, _ = merge_attention_outputs(out, lse, own_out, own_lse)
        self.record_density(pairs, H * (n * c0 + visible_pair_count(n, n, 0)))
        return own_out


# ---------------------------------------------------------------------------------------------- helpers
def _scores(ql: torch.Tensor, k: torch.Tensor, scale: float, kv_heads: slice = slice(None)) -> torch.Tensor:
    """fp32 scaled scores [h, L, W] of the queries ql [L, H, D] against k [W, KVH, D], q head h on kv head
    h // (H // KVH), restricted to the q heads of kv_heads."""
    L, H, D = ql.shape
    KVH = k.shape[1]
    group = H // KVH
    kk = k[:, kv_heads].float()  # [W, h_kv, D]
    h_kv = kk.shape[1]
    first = (kv_heads.start or 0) * group
    qq = ql[:, first:first + h_kv * group].float().reshape(L, h_kv, group, D)
    s = torch.matmul(qq.permute(1, 2, 0, 3), kk.permute(1, 2, 0)[:, None])  # [h_kv, group, L, W]
    return s.reshape(h_kv * group, L, -1) * scale


def _diagonal_sums(x: torch.Tensor, row0: int, key0: int) -> tuple[torch.Tensor, int]:
    """x [h, L, W] over rows at positions row0.. and keys at key0.. -> (sums [h, W+L-1], d_first): entry c
    sums x over the pairs with offset row - key = d_first + c."""
    h, L, W = x.shape
    flipped = torch.nn.functional.pad(x.flip(-1), (L, L)).contiguous()  # [h, L, W+2L]; key W-1-m at L+m
    # entry (i, c) of the view reads flipped[i, L + c - i]: the key with row - key = d_first + c
    view = flipped.as_strided((h, L, W + L - 1), (L * (W + 2 * L), W + 2 * L - 1, 1), L)
    return view.sum(1), row0 - key0 - (W - 1)


def _log_masses(s: torch.Tensor, lse_ref: torch.Tensor, row0: int, key0: int
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Log of the column and diagonal masses of exp(s - lse_ref) (s [h, L, W], -inf where invisible)."""
    logp = s - lse_ref[..., None]
    col = torch.logsumexp(logp, dim=1)  # [h, W]
    shift = logp.amax(dim=(1, 2), keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    sums, d_first = _diagonal_sums(torch.exp(logp - shift), row0, key0)
    return col, torch.log(sums) + shift[:, :, 0], d_first


def _top_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest values per row [h, k], padded with -inf when a row has fewer."""
    if x.shape[1] < k:
        x = torch.nn.functional.pad(x, (0, k - x.shape[1]), value=-_INF)
    return torch.topk(x, k, dim=1).values


def _kth(top: torch.Tensor, k: int) -> torch.Tensor:
    """[h, 1] threshold: the k-th largest value (+inf when k == 0: nothing but forced entries is kept)."""
    if k == 0:
        return torch.full((top.shape[0], 1), _INF, device=top.device)
    return top[:, k - 1:k]


def _sorted_selection(selected: torch.Tensor, base: int) -> torch.Tensor:
    """selected [h, W] bool -> [h, W] int32 sorted positions base + j of the selected entries, padded with
    an out-of-range sentinel (the kernel ignores it)."""
    positions = torch.arange(base, base + selected.shape[1], device=selected.device)
    keyed = torch.where(selected, positions[None, :], torch.full_like(positions, _SENTINEL)[None, :])
    return keyed.sort(dim=1).values.to(torch.int32)
