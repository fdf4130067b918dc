"""Quest: query-aware selection of the host blocks a decode step loads.

Metadata. While a block's keys are still on the GPU (on_prefill_offload / on_decode_offload), the policy records
per layer, per KV head and per channel the minimum and maximum key of the block: two device tables
[L, blocks, KVH, D] indexed by cpu block id (sparsekv.policies.block_metadata.BlockMetadata), allocated at
initialize() for the blocks the sequences can hold (declared by device_bytes_per_block). A partly filled prompt
block is recorded over its valid rows and re-recorded when decode fills it. Memory: 2 * KVH * D elements per block
and layer, i.e. 2 / block_size of the block's keys.

Score. For a query q and a block with bounds (kmin, kmax), no key k of the block can have q.k above the
per-channel upper bound  sum_i max(q_i * kmax_i, q_i * kmin_i)  (each channel takes the bound that its query sign
favours; computed as q+ . kmax + q- . kmin with q+ = max(q, 0), q- = min(q, 0), the same value). Per query head the
bounds of the candidate blocks are turned into attention shares (softmax of bound / sqrt(D) over the blocks), so
every head weighs alike; a KV head needs a block as much as the most interested query head of its GQA group (max
over the group), and since the ring loads whole blocks for every head, the KV heads' needs are summed into one
score per block.

Selection. Keep the `topk_blocks` best blocks, or token_budget // block_size blocks when `token_budget` is set
(token_budget wins when both are). With neither set: DEFAULT_TOKEN_BUDGET tokens, but at least DEFAULT_MIN_BLOCKS
blocks: on the probe's RULER matrix (docs/benchmarks.md) the smallest budget within 2 points of full at 32K is 2,048
tokens with 256-token blocks (8 blocks; 4 lose 25 points) and 7 blocks of the 1,024-token host blocks offloaded (6
lose 3 points). The first block (attention sink) and the newest full block are always kept, so at least 2 blocks
load whatever the budget. Layers below `dense_layers` and sequences with at most
`threshold_blocks` full blocks load everything. In decode the choice stays on the device (select_blocks returns a device
tensor): the chosen blocks are gathered from pinned host memory by a kernel, so no layer waits for the host. In decode,
scores and choice are one kernel launch (quest_select in sparsekv/policies/quest/quest_score.py); score_blocks and
sparsekv.policies.scorer.top_blocks are its reference.
A batched decode step chooses for all of its selecting sequences at once (select_blocks_batch): their candidates
padded to the longest, the same scores over the padded rows, one top-k per row. With offload=none the resident
store asks for every row of a decode batch at once from its block tables (select_blocks_paged: the same rows'
computation, no host sync), so the whole decode step is captured in a CUDA graph.

Decode only: prefill runs full attention (the factory pairs the phases), while the hooks still record the metadata
of every prompt block.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from sparsekv.policies.block_metadata import BlockMetadata
from sparsekv.policies.context import KVLayout, PagedChoice, PagedDecodeContext, PolicyContext, Selection
from sparsekv.policies.quest.quest_score import quest_block_shares, quest_select
from sparsekv.policies.quest.row_select import quest_select_rows
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.scorer import top_blocks

DEFAULT_TOKEN_BUDGET = 2048
DEFAULT_MIN_BLOCKS = 7  # the default budget keeps the sink, the newest block and at least 5 chosen ones
log = logging.getLogger(__name__)


def _check_int(name: str, value, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or null" if optional else "")
        raise ValueError(f"policy.{name}={value!r}: must be {allowed}")


@dataclass
class QuestPolicy(SparsePolicy):
    """Query-aware block selection for decode from per-block key min/max (Quest)."""
    name: str = "quest"
    token_budget: Optional[int] = None  # tokens of blocks loaded per step (both null: 2048, at least 7 blocks)
    topk_blocks: Optional[int] = None  # blocks loaded per step (token_budget wins when both are set)
    threshold_blocks: int = 0  # select only when the sequence has more full blocks than this
    dense_layers: int = 2  # the first layers load every block

    supports_prefill: ClassVar[bool] = False
    supports_decode: ClassVar[bool] = True
    requires_block_selection: ClassVar[bool] = True
    paged_device_selection: ClassVar[bool] = True  # offload=none: select_blocks_paged, captured whole

    def __post_init__(self) -> None:
        _check_int("token_budget", self.token_budget, 1, optional=True)
        _check_int("topk_blocks", self.topk_blocks, 1, optional=True)
        _check_int("threshold_blocks", self.threshold_blocks, 0)
        _check_int("dense_layers", self.dense_layers, 0)
        self._kmax: BlockMetadata | None = None  # [L, blocks, KVH, D]
        self._kmin: BlockMetadata | None = None

    def budget_blocks(self, block_size: int) -> int:
        """Blocks loaded per (layer, step) when selecting: at least the sink and the newest block."""
        if self.token_budget is not None:
            return max(self.token_budget // block_size, 2)
        if self.topk_blocks is not None:
            return max(self.topk_blocks, 2)
        return max(DEFAULT_TOKEN_BUDGET // block_size, DEFAULT_MIN_BLOCKS)

    # ---- metadata hooks (keys still on the GPU)
    def initialize(self, layout: KVLayout) -> None:
        if self.budget_blocks(layout.block_size) <= 2:
            budget = (f"policy.token_budget={self.token_budget}" if self.token_budget is not None
                      else f"policy.topk_blocks={self.topk_blocks}")
            log.warning(f"quest: {budget} with blocks of {layout.block_size} tokens keeps only the sink and the newest "
                        "block, so Quest chooses nothing (a StreamingLLM window); give it at least 3 blocks "
                        f"(token_budget >= {3 * layout.block_size}) or smaller blocks (offload.block_size), or leave "
                        f"token_budget and topk_blocks unset (at least {DEFAULT_MIN_BLOCKS} blocks)")
        shape = (layout.num_kv_heads, layout.head_dim)
        self._kmax, self._kmin = (BlockMetadata(layout.num_layers, shape, layout.dtype, layout.device,
                                                layout.max_blocks, rows=layout.expected_blocks) for _ in range(2))

    def device_bytes_per_block(self, layout: KVLayout) -> int:
        return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * layout.dtype.itemsize  # kmax, kmin

    def on_prefill_offload(self, block_id: int, layer: int, keys: torch.Tensor, n: int) -> None:
        if self._kmax is None or self._kmin is None:
            raise RuntimeError("QuestPolicy.initialize() must run before blocks are offloaded")
        keys = keys[:n]  # [n, KVH, D]
        self._kmax.write(layer, block_id, keys.amax(dim=0))
        self._kmin.write(layer, block_id, keys.amin(dim=0))

    # ---- scores
    def upper_bounds(self, query: torch.Tensor, block_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """query [Nq, H, D], block_ids [n] int64 on the device -> [n, Nq, KVH, G] fp32: per block and query head,
        sum_i max(q_i * kmax_i, q_i * kmin_i) >= q . k for every key k of the block."""
        if self._kmax is None or self._kmin is None:
            raise RuntimeError("QuestPolicy.initialize() must run before blocks are selected")
        kmax = self._kmax.gather(layer, block_ids).float()  # [n, KVH, D]
        kmin = self._kmin.gather(layer, block_ids).float()
        nq, heads, dim = query.shape
        kv_heads = kmax.shape[1]
        q = query.float().view(nq, kv_heads, heads // kv_heads, dim)  # [Nq, KVH, G, D]
        return (torch.einsum("qkgd,nkd->nqkg", q.clamp(min=0), kmax)
                + torch.einsum("qkgd,nkd->nqkg", q.clamp(max=0), kmin))

    def block_scores(self, query: torch.Tensor, block_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """query [Nq, H, D], block_ids [n] int64 on the device -> [n] fp32: each block's estimated attention share,
        summed over KV heads (and query tokens)."""
        scale = query.shape[-1] ** -0.5
        if query.shape[0] == 1 and self._kmax is not None and self._kmin is not None:  # decode: one fused launch
            return quest_block_shares(query[0], self._kmax.data[layer], self._kmin.data[layer], block_ids,
                                      scale).sum(dim=0)  # [KVH, n] -> [n]
        bound = self.upper_bounds(query, block_ids, layer)  # [n, Nq, KVH, G]
        share = torch.softmax(bound * scale, dim=0)  # per query head, over the blocks
        return share.amax(dim=3).sum(dim=(1, 2))  # max over the GQA group, sum over KV heads -> [n]

    def score_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        """[n] fp32 per candidate, as a ScorerPolicy would score (the reference of the fused decode path)."""
        return self.block_scores(ctx.query, ctx.candidate_ids, ctx.layer)

    # ---- selection
    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor | None:
        """The chosen block ids [keep] int64 on the device (sink, newest, then the best of the middle), or None
        when every block loads (dense layer, short sequence, budget covering all)."""
        n = len(ctx.candidates)
        if ctx.layer < self.dense_layers or n <= self.threshold_blocks:
            return None
        keep = self.budget_blocks(ctx.block_size)
        if n <= keep:
            return None
        ids = ctx.candidate_ids  # the store's copy, which outlives graph captures
        if ctx.query.shape[0] == 1 and self._kmax is not None and self._kmin is not None:  # decode: one launch
            return quest_select(ctx.query[0], self._kmax.data[ctx.layer], self._kmin.data[ctx.layer], ids,
                                ctx.query.shape[-1] ** -0.5, keep)
        return top_blocks(ids, self.block_scores(ctx.query, ids, ctx.layer), keep, 1, 1)

    def select_blocks_batch(self, ctxs: list[PolicyContext]) -> list[Selection]:
        """select_blocks for a batch's decode contexts of one layer: the same choices (as sets), the selecting
        sequences' in one computation over their candidates padded to the longest (memory: rows * longest * KVH * D
        fp32 per table)."""
        rows = [i for i, ctx in enumerate(ctxs) if self._selects(ctx)]
        if len(rows) < 2 or any(ctxs[i].query.shape[0] != 1 or ctxs[i].layer != ctxs[0].layer for i in rows):
            return super().select_blocks_batch(ctxs)
        chosen = self._select_padded([ctxs[i] for i in rows])  # [R, keep]
        out: list[Selection] = [None] * len(ctxs)
        for row, i in enumerate(rows):
            out[i] = chosen[row]
        return out

    def _selects(self, ctx: PolicyContext) -> bool:
        n = len(ctx.candidates)
        return ctx.layer >= self.dense_layers and n > self.threshold_blocks and n > self.budget_blocks(ctx.block_size)

    def _select_padded(self, ctxs: list[PolicyContext]) -> torch.Tensor:
        """[R, keep] chosen ids of R selecting decode contexts: sink, newest, then the best of the middle."""
        kmax, kmin = self._tables(ctxs[0].layer)
        first = ctxs[0]
        keep, width = self.budget_blocks(first.block_size), max(len(ctx.candidates) for ctx in ctxs)
        padded = [block for ctx in ctxs for block in [*ctx.candidates, *[-1] * (width - len(ctx.candidates))]]
        if first.ids_source is not None:  # the store's copy, one per distinct content: graph replays read it
            flat = first.ids_source(padded)
        else:
            flat = torch.tensor(padded, dtype=torch.int64).to(first.query.device, non_blocking=True)
        ids = flat.view(len(ctxs), width)  # [R, N], -1 past each row's candidates
        query = torch.cat([ctx.query for ctx in ctxs])  # [R, H, D]
        return quest_select_rows(query, kmax, kmin, ids, (ids >= 0).sum(dim=1), query.shape[-1] ** -0.5, keep)

    def select_blocks_paged(self, ctx: PagedDecodeContext) -> PagedChoice | None:
        """offload=none: every row's choice at once, on the device. Rows with more than max(keep, threshold_blocks)
        full blocks choose keep of them; the others keep all theirs (at most that many): C = max(keep, threshold)."""
        keep = self.budget_blocks(ctx.block_size)
        limit = max(keep, self.threshold_blocks)  # rows with more full blocks than this select
        ids = ctx.candidates  # [B, W]
        if ctx.layer < self.dense_layers or ids.shape[1] <= limit:
            return None  # no row can select
        kmax, kmin = self._tables(ctx.layer, whole=True)
        counts = ctx.num_candidates  # [B]
        chosen = quest_select_rows(ctx.query, kmax, kmin, ids, counts, ctx.query.shape[-1] ** -0.5, keep)
        selects = counts > limit  # [B]
        chosen = torch.cat([chosen, ids[:, keep:limit]], dim=1)  # [B, limit]; the columns past keep: never read
        blocks = torch.where(selects[:, None], chosen, ids[:, :limit])
        return PagedChoice(blocks, torch.where(selects, torch.full_like(counts, keep), counts))

    def _tables(self, layer: int, whole: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's key max/min tables [blocks, KVH, D]; `whole`: grown first to every block id of the layout,
        so that a captured step reads tables that no later block write reallocates."""
        if self._kmax is None or self._kmin is None:
            raise RuntimeError("QuestPolicy.initialize() must run before blocks are selected")
        if whole:
            for table in (self._kmax, self._kmin):
                if table.max_blocks and table.capacity < table.max_blocks:
                    table.ensure(table.max_blocks - 1)
        return self._kmax.data[layer], self._kmin.data[layer]
