"""XAttention block-sparse prefill: antidiagonal scoring, threshold selection, majority vote across heads.

Scoring (XAttention). Within every stride x stride tile of the attention matrix, the sum along the antidiagonal
touches each query row and each key column of the tile once, so a strong vertical line (a key many queries read)
or slash line (a fixed offset) shows up in it. Reshaping queries with reversed offsets and keys with forward
offsets along the stride turns all antidiagonal sums into one matmul:
    q_r[i] = concat_t q[i*stride + stride-1-t],   k_r[j] = concat_t k[j*stride + t]      (t = 0..stride-1)
    score[i, j] = q_r[i] . k_r[j] / sqrt(D) / stride      (the mean of the tile's antidiagonal logits)
A causal softmax over j per strided row, summed into (query block, key block) cells of `block_size` tokens,
estimates each key block's attention mass for each query block. Per query block (and KV head: the masses of the
query heads of a GQA group are summed) the key blocks are kept in descending mass until the kept mass reaches
`threshold` of the row. One set of blocks must then serve every head (the offload ring loads whole blocks), so a
block is kept when at least `vote_fraction` of the KV heads keep it (majority voting). The first (sink) block
and the diagonal block are always kept.

offload=none (compute_prefill; the keys are all on the device): the scoring runs on the real keys at
`block_size` granularity (sparsekv.policies.xattn.xattn_estimate: one fused matmul pass over the strided scores that
keeps only per-(row, key block) log-sum-exps, then the normalised masses), the threshold, the vote and the runs of kept
blocks the attention kernel walks in two more launches (sparsekv.policies.xattn.block_select), and the attention is
computed exactly over each query block's own kept blocks by one block-sparse kernel
(sparsekv.policies.xattn.block_sparse_attention): no host sync. Each query block's estimate covers every key it sees,
so a prompt prefilled in scheduler.max_num_batched_tokens chunks and one prefilled in one step (that budget at least
its length) select the same blocks; one step is ~3% faster at 128K for the activations of the whole prompt
(docs/decisions.md).

offload=cpu (compute_chunked_prefill). When the GPU block cache holds the prefix in one run of slots and the chunk
was written right after it (ctx.sequence_kv: the usual case when the cache can hold the prompt), the whole sequence
so far is one device view and the chunk is computed as offload=none computes it: compute_prefill on the view, so
selection, result and density (block pairs) are offload=none's; so is the first chunk (no prefix: its own keys are
the whole sequence). Otherwise the base pipeline runs: later chunks without the view (no cache, fp8 host blocks, a
prefix the cache holds only in part) attend the prefix host blocks that select_blocks(ctx) keeps. Those prefix keys live
on the host and only the chosen blocks may cross PCIe, so the decision uses a key summary kept on the GPU.
Summary: for every host block and layer, the mean of each run of `summary_stride` (default: `stride`) consecutive
keys, [block_size / summary_stride, KVH, D] in the key dtype, recorded by on_prefill_offload / on_decode_offload
while the keys are on the GPU (a device table indexed by cpu block id, sized at initialize()). That is
1/summary_stride of the block's keys, 1/(2*summary_stride) of its KV: for Qwen3-4B (KVH 8, D 128, bf16) with
1024-token host blocks and stride 8, 256 KiB per block and layer against 4 MiB of KV (6.25%), 9 MiB per block over
36 layers.
Why means: if the queries of a stride group are replaced by their mean q_bar, the antidiagonal score of a tile
becomes q_bar . (mean of the tile's keys) / sqrt(D), so the per-group key mean is exactly the key side of the
scoring under that approximation; a single strong key is diluted by 1/stride, just as in the antidiagonal sum.
The chunk's queries are averaged over stride groups the same way and scored against the summaries of the prefix
blocks (softmax over all prefix summaries), the masses summed per (query block, host block) with query blocks of
one host block each; threshold and vote as above, then the union over the chunk's query blocks (the ring loads
one set for the whole chunk), plus block 0 and the newest prefix block. The chunk's own keys are attended
densely by the pipeline and are not part of the estimate, so the threshold is taken over the prefix's mass
(it errs toward keeping blocks). `block_size` does not apply here: the granularity is the host block.

Decode is dense (supports_decode=False: the factory pairs it with `full`). `last_density` is the last
selection's kept fraction: kept prefix blocks / prefix blocks (offload=cpu, base pipeline), computed (query block,
key block) pairs / causally visible pairs (offload=none, and offload=cpu on ctx.sequence_kv); `mean_density` is the
same over every selection (base class).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from sparsekv.policies.xattn.block_lists import BlockRuns, block_mask_from_lists
from sparsekv.policies.xattn.block_select import select_block_runs, threshold_keep
from sparsekv.policies.xattn.block_sparse_attention import block_sparse_attention_runs
from sparsekv.policies.xattn.xattn_estimate import xattn_block_mass
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.block_metadata import BlockMetadata
from sparsekv.policies.context import KVLayout, KVReader, PolicyContext

SCORE_ELEMENTS = 1 << 25  # fp32 summary scores (offload=cpu) materialised at once


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _group_means(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [n, ...] -> fp32 [ceil(n / width), ...]: the mean of each run of `width` rows (the last run may be short)."""
    n = x.shape[0]
    groups = _cdiv(n, width)
    x = x.float()
    if groups * width == n:
        return x.view(groups, width, *x.shape[1:]).mean(dim=1)
    x = torch.cat([x, x.new_zeros(groups * width - n, *x.shape[1:])])
    counts = torch.full((groups,), float(width), device=x.device)
    counts[-1:].fill_(n - (groups - 1) * width)
    return x.view(groups, width, *x.shape[1:]).sum(dim=1) / counts.view(groups, *([1] * (x.dim() - 1)))


@dataclass
class XAttentionPolicy(SparsePolicy):
    """XAttention antidiagonal block selection for prefill (block-sparse attention)."""
    name: str = "xattn_bsa"
    # the smallest threshold of the probe's RULER matrix within 2 points of full at 32K (docs/benchmarks.md: it loses
    # 2.9 points at 4K, where xattn_bsa_090 loses none)
    threshold: float = 0.7  # cumulative attention mass kept per query block, in (0, 1]
    stride: int = 8  # antidiagonal stride of the scoring
    block_size: int = 128  # offload=none: tokens per query/key block (a multiple of stride)
    vote_fraction: float = 0.5  # a block is kept when at least this fraction of the KV heads keep it
    summary_stride: Optional[int] = None  # offload=cpu: keys averaged per summary vector (null: stride)

    supports_prefill: ClassVar[bool] = True
    supports_decode: ClassVar[bool] = False
    requires_block_selection: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name, minimum in (("stride", 1), ("block_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"policy.{name}={value!r}: must be an integer >= {minimum}")
        if self.summary_stride is not None and (isinstance(self.summary_stride, bool)
                                                or not isinstance(self.summary_stride, int) or self.summary_stride < 1):
            raise ValueError(f"policy.summary_stride={self.summary_stride!r}: must be an integer >= 1 or null")
        if self.block_size % self.stride:
            raise ValueError(f"policy.block_size={self.block_size} must be a multiple of policy.stride={self.stride}")
        for name in ("threshold", "vote_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                    or not 0.0 < value <= 1.0:
                raise ValueError(f"policy.{name}={value!r}: must be a number in (0, 1]")
        self._summary: BlockMetadata | None = None  # [L, blocks, groups, KVH, D] key means
        self._groups: BlockMetadata | None = None  # [L, blocks] valid summary groups per block

    # ---------------------------------------------------------------------------------------- shared
    def _votes_needed(self, kv_heads: int) -> int:
        """KV heads that must keep a block for it to be kept: at least vote_fraction of them, at least one."""
        return max(1, math.ceil(self.vote_fraction * kv_heads - 1e-9))

    def _vote(self, keep: torch.Tensor) -> torch.Tensor:
        """keep [KVH, ...] bool -> [...]: kept by at least vote_fraction of the KV heads."""
        return keep.sum(dim=0) >= self._votes_needed(keep.shape[0])

    # ---------------------------------------------------------------------------------------- offload=none
    def block_mass(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Antidiagonal estimate of the attention mass per (KV head, query block, key block).

        q [n, H, D] are the last n positions of k [S, KVH, D]; blocks are `block_size` tokens from position 0.
        -> [KVH, nqb, nkb] fp32 with nkb = ceil(S / B), nqb = nkb - (S - n) // B (the blocks holding the queries);
        each entry sums the softmax mass of the GQA group's query heads over the block's strided rows
        (sparsekv.policies.xattn.xattn_estimate: fused Triton kernels, or the pure-torch reference).
        """
        return xattn_block_mass(q, k, self.stride, self.block_size)

    def select_prefill_runs(self, q: torch.Tensor, k: torch.Tensor) -> tuple[BlockRuns, torch.Tensor]:
        """offload=none selection as the block-sparse kernel reads it: (the runs of every query block's kept key
        blocks, count [nqb] of kept blocks), for q [n, H, D] the last n positions of k [S, KVH, D]
        (block_select.select_block_runs: two launches after the estimate, no host sync)."""
        seq, kv_heads = k.shape[:2]
        qb0, nkb = (seq - q.shape[0]) // self.block_size, _cdiv(seq, self.block_size)
        mass = self.block_mass(q, k) if self.threshold < 1.0 else \
            torch.zeros(kv_heads, nkb - qb0, nkb, device=q.device)  # every visible block: no estimate needed
        return select_block_runs(mass, qb0, self.threshold, self._votes_needed(kv_heads))

    def select_prefill_blocks(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The same selection as a mask: (keep [nqb, nkb] bool on the device, index of the first query block)."""
        runs, count = self.select_prefill_runs(q, k)
        seq, bs = k.shape[0], self.block_size
        return block_mask_from_lists(runs.idx, count, _cdiv(seq, bs)), (seq - q.shape[0]) // bs

    def compute_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                        softmax_scale: float) -> torch.Tensor:
        """q [n, H, D] are the last n positions of k/v [S, KVH, D] -> [n, H, D], block-sparse: every query block
        attends to exactly its own kept key blocks (one kernel launch, no host sync)."""
        n, seq, bs = q.shape[0], k.shape[0], self.block_size
        nkb = _cdiv(seq, bs)
        qb0 = (seq - n) // bs
        visible = (qb0 + 1 + nkb) * (nkb - qb0) // 2  # sum of qb + 1 over the query blocks qb0 .. nkb-1
        if nkb <= 2 or self.threshold >= 1.0:  # every visible block is the sink or a diagonal / all kept
            self.record_density(visible, visible)
            return super().compute_prefill(q, k, v, layer_id, softmax_scale)
        runs, count = self.select_prefill_runs(q, k)
        self.record_density(count.sum(), visible)  # a device count: read (and synced) only when reported
        out, _ = block_sparse_attention_runs(q, k, v, runs, bs, softmax_scale, seq - n)
        return out

    # ---------------------------------------------------------------------------------------- offload=cpu
    def compute_chunked_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PolicyContext,
                                reader: KVReader) -> torch.Tensor:
        """q [n, H, D], k/v [n, KVH, D] of this chunk -> [n, H, D]: compute_prefill on ctx.sequence_kv when the
        store gives it (or, for the first chunk, on its own keys: they are the whole sequence), else the base
        pipeline over select_blocks (module docstring)."""
        if ctx.sequence_kv is not None:
            k_all, v_all = ctx.sequence_kv  # [kv_len, KVH, D]: the prefix, then this chunk
            return self.compute_prefill(q, k_all, v_all, ctx.layer, ctx.softmax_scale)
        if ctx.query_start == 0:
            return self.compute_prefill(q, k, v, ctx.layer, ctx.softmax_scale)
        return super().compute_chunked_prefill(q, k, v, ctx, reader)

    def _summary_shape(self, layout: KVLayout) -> tuple[int, int, int]:
        """[groups, KVH, D] of one block and layer: a full block's groups (a partial block fills fewer)."""
        return _cdiv(layout.block_size, self.summary_group), layout.num_kv_heads, layout.head_dim

    def initialize(self, layout: KVLayout) -> None:
        self._summary = BlockMetadata(layout.num_layers, self._summary_shape(layout), layout.dtype, layout.device,
                                      layout.max_blocks, rows=layout.expected_blocks)
        self._groups = BlockMetadata(layout.num_layers, (), torch.int32, layout.device, layout.max_blocks,
                                     rows=layout.expected_blocks)

    def device_bytes_per_block(self, layout: KVLayout) -> int:
        summary = math.prod(self._summary_shape(layout)) * layout.dtype.itemsize
        return layout.num_layers * (summary + torch.int32.itemsize)  # the summary and the group count

    def on_prefill_offload(self, block_id: int, layer: int, keys: torch.Tensor, n: int) -> None:
        self._record(block_id, layer, keys, n)

    @property
    def summary_group(self) -> int:
        return self.summary_stride or self.stride

    def _record(self, cpu_block_id: int, layer_id: int, k_cache: torch.Tensor, n: int) -> None:
        if self._summary is None or self._groups is None:
            raise RuntimeError("XAttentionPolicy.initialize() must run before blocks are offloaded")
        width = self.summary_group
        groups = _cdiv(n, width)
        means = _group_means(k_cache[:n], width)  # [groups, KVH, D]
        self._summary.ensure(cpu_block_id)
        self._summary.data[layer_id, cpu_block_id, :groups] = means.to(self._summary.dtype)
        self._groups.ensure(cpu_block_id)
        self._groups.data[layer_id, cpu_block_id:cpu_block_id + 1].fill_(groups)  # a device fill, no host copy

    def prefix_block_mass(self, query: torch.Tensor, block_ids: torch.Tensor, layer_id: int, block_size: int,
                          chunk_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Estimated mass of the chunk's queries [n, H, D] (block-aligned, after the prefix) on each prefix host
        block, from the key summaries -> ([KVH, nqb, nb] fp32, query blocks of block_size rows; own).

        With the chunk's own keys [n, KVH, D], their group means (causal at group granularity) join the softmax,
        so the masses are shares of the whole row, as in XAttention, and own [KVH, nqb] is the mass on the chunk's
        own keys (computed densely anyway); without them own is None and the prefix shares sum to 1."""
        assert self._summary is not None and self._groups is not None
        n, heads, dim = query.shape
        summary = self._summary.gather(layer_id, block_ids)  # [nb, groups, KVH, D]
        nb, groups, kv_heads, _ = summary.shape
        group = heads // kv_heads
        dev = query.device
        valid = torch.arange(groups, device=dev)[None, :] < self._groups.gather(layer_id, block_ids)[:, None]
        prefix_cols = nb * groups
        keys_t = summary.permute(2, 3, 0, 1).reshape(kv_heads, dim, prefix_cols)  # [KVH, D, nb * groups]
        width, own_width = self.stride, self.summary_group
        rows = _cdiv(n, width)
        own_cols = 0
        if chunk_keys is not None:
            own = _group_means(chunk_keys, own_width).to(summary.dtype)  # [own_cols, KVH, D]
            own_cols = own.shape[0]
            keys_t = torch.cat([keys_t, own.permute(1, 2, 0)], dim=2)  # [KVH, D, prefix_cols + own_cols]
        q_mean = (_group_means(query, width) * dim ** -0.5).to(summary.dtype)  # [rows, H, D], scaled
        q_mean = q_mean.view(rows, kv_heads, group, dim).permute(1, 2, 0, 3)  # [KVH, G, rows, D]
        q_block = torch.div(torch.arange(rows, device=dev) * width, block_size, rounding_mode="floor")
        nqb = _cdiv(n, block_size)
        cols = prefix_cols + own_cols
        # [rows, cols]: prefix columns by validity; own group j when its first key is at or before the row's last query
        col_ok = torch.cat([valid.flatten()[None, :].expand(rows, -1),
                            torch.arange(own_cols, device=dev)[None, :] * own_width
                            <= torch.arange(rows, device=dev)[:, None] * width + width - 1], dim=1)
        mass = torch.zeros(kv_heads, nqb, nb, dtype=torch.float32, device=dev)
        own_mass = torch.zeros(kv_heads, nqb, dtype=torch.float32, device=dev) if own_cols else None
        step = max(1, SCORE_ELEMENTS // max(1, heads * cols))
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            scores = torch.bmm(q_mean[:, :, r0:r1].reshape(kv_heads, group * (r1 - r0), dim), keys_t)
            scores = scores.view(kv_heads, group, r1 - r0, cols).masked_fill_(~col_ok[r0:r1], float("-inf"))
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).sum(dim=1)  # [KVH, rows, cols]
            mass.index_add_(1, q_block[r0:r1], p[..., :prefix_cols].unflatten(-1, (nb, groups)).sum(-1))
            if own_mass is not None:
                own_mass.index_add_(1, q_block[r0:r1], p[..., prefix_cols:].sum(-1))
        return mass, own_mass

    def select_blocks(self, ctx: PolicyContext) -> list[int] | None:
        available_blocks = ctx.candidates
        nb = len(available_blocks)
        if nb <= 2 or self.threshold >= 1.0 or self._summary is None:
            self.record_density(nb, nb)
            return None
        mass, own = self.prefix_block_mass(ctx.query, ctx.candidate_ids, ctx.layer, ctx.block_size,
                                           ctx.chunk_keys)  # [KVH, nqb, nb]
        keep = threshold_keep(mass, self.threshold, kept=own)
        chosen = self._vote(keep).any(dim=0)  # union over query blocks -> [nb]
        chosen[:1].fill_(True)  # attention sink (fill_ on a view: no host-to-device copy)
        chosen[-1:].fill_(True)  # newest prefix block
        flags = chosen.tolist()  # the one host sync per (layer, chunk)
        selected = [block for block, keep in zip(available_blocks, flags) if keep]
        self.record_density(len(selected), nb)
        return selected
