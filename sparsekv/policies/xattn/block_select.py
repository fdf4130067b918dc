"""XAttention's block selection, from the estimated masses to the runs the block-sparse kernel walks, fused.

select_block_runs(mass [KVH, nqb, nkb] fp32, qb0, threshold, need) -> (BlockRuns, count [nqb] int32)

Query block qb0 + r sees key blocks 0 .. qb0 + r. Per KV head, a row keeps its visible key blocks in descending mass
until the kept mass reaches `threshold` of the row's visible total (threshold_keep: a block is kept when the mass
of the blocks heavier than it is below threshold x total, so tied blocks are kept or dropped together); a block is
then kept for the query block when at least `need` KV heads keep it (majority voting), and the sink block 0 and the
diagonal block qb0 + r always. The result is block_lists.block_runs' of those lists (entries past a row's counts
are undefined), and count the kept blocks per query block.

Triton, two launches in place of the ~60 small torch ops of the reference (sort, cumsum, scatter, the list and run
building), which left the GPU idle between them once per layer and chunk:
  1. _threshold_kernel, one program per (query block, KV head): the row's total, then the smallest float bit
     pattern c whose heavier blocks weigh less than threshold x total, by bisection over the 31 bits (the bits of
     a non-negative float order as the float does); the row keeps its blocks of at least c. keep [KVH, nqb, nkb]
     int8.
  2. _runs_kernel, one program per query block: the votes, then the ascending list, the runs of consecutive kept
     blocks before the diagonal, their counts and the diagonal flag, by prefix sums over tiles of the row.
The reference (threshold_keep, block_lists_from_mask, block_runs) runs where Triton does not, and for
threshold >= 1 (every visible block).
"""

from __future__ import annotations

import torch

from sparsekv.kernels._dispatch import HAS_TRITON, jit, tl, triton_interpret, use_triton
from sparsekv.policies.xattn.block_lists import BlockRuns, block_lists_from_mask, block_runs

__all__ = ["select_block_runs", "select_block_runs_reference", "threshold_keep"]

# Key blocks a program holds at once, one size for every row so that one compiled kernel serves every chunk of a
# prompt (a tile sized to the row compiled a variant per power of two mid-prefill). 1M tokens in 128-token blocks
# is 8,192 blocks: 8 tiles.
TILE = 1024
INTERPRET_TILE = 16  # small tiles exercise the tile loops under the CPU interpreter
INF_BITS = 0x7F800000  # the bit pattern of +inf: above every finite mass


def threshold_keep(mass: torch.Tensor, threshold: float, visible: torch.Tensor | None = None,
                   kept: torch.Tensor | None = None) -> torch.Tensor:
    """mass [..., R, C] >= 0 -> bool [..., R, C]: per row, the columns in descending mass until the kept mass reaches
    `threshold` of the row's total (the column that crosses it included): a column is kept when the columns heavier
    than it weigh less than threshold x total, so equal columns are kept together. Only `visible` [R, C] columns
    count. `kept` [..., R]: mass the row keeps anyway (outside these columns), counted in the kept mass and the
    total."""
    if visible is not None:
        mass = mass.masked_fill(~visible, 0.0)
    if threshold >= 1.0:
        keep = torch.ones_like(mass, dtype=torch.bool)
    else:
        ordered, order = mass.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # mass kept before each column joins
        position = torch.arange(ordered.shape[-1], device=mass.device).expand_as(ordered)
        first_of_ties = torch.ones_like(ordered, dtype=torch.bool)
        first_of_ties[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
        before = before.gather(-1, torch.where(first_of_ties, position, 0).cummax(dim=-1).values)
        total = mass.sum(dim=-1, keepdim=True)
        if kept is not None:
            before, total = before + kept[..., None], total + kept[..., None]
        keep_sorted = before < threshold * total
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep & visible if visible is not None else keep


# ----------------------------------------------------------------------------------------- Triton kernels
# Triton compiles a variant per integer argument equal to 1 or divisible by 16; the row lengths and strides grow with
# every chunk, so they are not specialised: one compiled kernel per tile size serves a whole prompt.
@jit(do_not_specialize=["stride_mh", "stride_mq", "stride_kh", "stride_kq", "nkb", "qb0"])
def _threshold_kernel(MASS, KEEP, stride_mh, stride_mq, stride_kh, stride_kq, nkb, qb0, threshold,
                      TILE: tl.constexpr):
    r = tl.program_id(0)
    head = tl.program_id(1)
    ncols = tl.minimum(qb0 + r + 1, nkb)  # the visible key blocks
    row = MASS + head.to(tl.int64) * stride_mh + r.to(tl.int64) * stride_mq
    offs = tl.arange(0, TILE)
    total = 0.0
    for c0 in range(0, ncols, TILE):
        total += tl.sum(tl.load(row + c0 + offs, mask=c0 + offs < ncols, other=0.0))
    target = threshold * total
    # heavier(c) = the mass of the blocks whose bits exceed c falls as c grows: find the smallest c with
    # heavier(c) < target. heavier(-1) = total >= target; heavier(INF_BITS) = 0 (< target unless target is 0).
    lo = -1
    hi = 0x7F800000  # INF_BITS
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        heavier = 0.0
        for c0 in range(0, ncols, TILE):
            m = tl.load(row + c0 + offs, mask=c0 + offs < ncols, other=0.0)
            heavier += tl.sum(tl.where(m.to(tl.int32, bitcast=True) > mid, m, 0.0))
        below = heavier < target
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid)
    out = KEEP + head.to(tl.int64) * stride_kh + r.to(tl.int64) * stride_kq
    for c0 in range(0, ncols, TILE):
        m = tl.load(row + c0 + offs, mask=c0 + offs < ncols, other=0.0)
        keep = m.to(tl.int32, bitcast=True) >= hi  # none when the row has no mass (hi stays at +inf's bits)
        tl.store(out + c0 + offs, keep.to(tl.int8), mask=c0 + offs < ncols)


@jit
def _kept(KEEP, stride_kh, row_off, kb, ncols, qb, kv_heads, need):
    # [TILE] block kb kept for the query block: voted by `need` KV heads, or the sink, or the diagonal block
    ok = (kb >= 0) & (kb < ncols)
    votes = tl.zeros(kb.shape, dtype=tl.int32)
    for head in range(0, kv_heads):
        votes += tl.load(KEEP + head * stride_kh + row_off + kb, mask=ok, other=0).to(tl.int32)
    return ok & ((votes >= need) | (kb == 0) | (kb == qb))


@jit(do_not_specialize=["stride_kh", "stride_kq", "stride_ir", "nkb", "qb0"])
def _runs_kernel(KEEP, IDX, LO, HI, NFULL, NRUNS, DIAG, COUNT, stride_kh, stride_kq, stride_ir,
                 nkb, qb0, kv_heads, need, TILE: tl.constexpr):
    r = tl.program_id(0)
    qb = qb0 + r
    ncols = tl.minimum(qb + 1, nkb)
    row_off = r.to(tl.int64) * stride_kq
    out_off = r.to(tl.int64) * stride_ir
    offs = tl.arange(0, TILE)
    n_kept = 0
    n_starts = 0
    n_ends = 0
    n_full = 0
    diag = 0
    for c0 in range(0, ncols, TILE):
        kb = c0 + offs
        keep = _kept(KEEP, stride_kh, row_off, kb, ncols, qb, kv_heads, need)
        full = keep & (kb < qb)  # before the diagonal: every key visible to every row
        full_prev = _kept(KEEP, stride_kh, row_off, kb - 1, ncols, qb, kv_heads, need) & (kb - 1 < qb)
        full_next = _kept(KEEP, stride_kh, row_off, kb + 1, ncols, qb, kv_heads, need) & (kb + 1 < qb)
        starts = full & ~full_prev
        ends = full & ~full_next
        slot = n_kept + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(IDX + out_off + slot, kb, mask=keep)
        slot = n_starts + tl.cumsum(starts.to(tl.int32), 0) - 1
        tl.store(LO + out_off + slot, kb, mask=starts)
        slot = n_ends + tl.cumsum(ends.to(tl.int32), 0) - 1
        tl.store(HI + out_off + slot, kb + 1, mask=ends)
        n_kept += tl.sum(keep.to(tl.int32))
        n_starts += tl.sum(starts.to(tl.int32))
        n_ends += tl.sum(ends.to(tl.int32))
        n_full += tl.sum(full.to(tl.int32))
        diag += tl.sum((keep & (kb == qb)).to(tl.int32))
    tl.store(NFULL + r, n_full)
    tl.store(NRUNS + r, n_starts)
    tl.store(DIAG + r, diag)
    tl.store(COUNT + r, n_kept)


# ------------------------------------------------------------------------------------------- launchers
def _check_inputs(mass: torch.Tensor, qb0: int, threshold: float, need: int) -> None:
    if not isinstance(mass, torch.Tensor) or mass.dim() != 3 or mass.dtype != torch.float32:
        got = (tuple(mass.shape), mass.dtype) if isinstance(mass, torch.Tensor) else type(mass).__name__
        raise ValueError(f"expected mass as float32 [KVH, nqb, nkb]; got {got}")
    kv_heads, nqb, nkb = mass.shape
    if isinstance(qb0, bool) or not isinstance(qb0, int) or qb0 < 0 or qb0 + nqb > nkb:
        raise ValueError(f"qb0={qb0!r}: the query blocks qb0 .. qb0 + {nqb} - 1 must lie among the {nkb} key blocks")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold={threshold!r}: must be a number in (0, 1]")
    if isinstance(need, bool) or not isinstance(need, int) or not 1 <= need <= max(kv_heads, 1):
        raise ValueError(f"need={need!r}: must be an integer in [1, KVH={kv_heads}]")


def select_block_runs_reference(mass: torch.Tensor, qb0: int, threshold: float,
                                need: int) -> tuple[BlockRuns, torch.Tensor]:
    """Pure torch: threshold_keep per KV head, the vote, the sink and diagonal, then block_runs of the lists."""
    _check_inputs(mass, qb0, threshold, need)
    _, nqb, nkb = mass.shape
    qb = torch.arange(qb0, qb0 + nqb, device=mass.device)[:, None]  # [nqb, 1] absolute query block
    kb = torch.arange(nkb, device=mass.device)[None, :]  # [1, nkb]
    visible = kb <= qb
    voted = threshold_keep(mass, threshold, visible).sum(dim=0) >= need  # [nqb, nkb]
    keep = visible & (voted | (kb == 0) | (kb == qb))
    block_idx, count = block_lists_from_mask(keep)
    return block_runs(block_idx, count, qb0), count


def select_block_runs(mass: torch.Tensor, qb0: int, threshold: float, need: int) -> tuple[BlockRuns, torch.Tensor]:
    """mass [KVH, nqb, nkb] fp32 of query blocks qb0.. -> (BlockRuns of the kept lists, count [nqb] int32): see the
    module docstring. Two Triton launches on CUDA (or on CPU under TRITON_INTERPRET=1), else the reference. No host
    sync."""
    _check_inputs(mass, qb0, threshold, need)
    kv_heads, nqb, nkb = mass.shape
    if threshold >= 1.0 or nqb == 0 or not (HAS_TRITON and use_triton(mass.device)):
        return select_block_runs_reference(mass, qb0, threshold, need)
    dev = mass.device
    if mass.stride(2) != 1:
        mass = mass.contiguous()
    tile = INTERPRET_TILE if triton_interpret() else TILE
    keep = torch.empty((kv_heads, nqb, nkb), dtype=torch.int8, device=dev)
    _threshold_kernel[(nqb, kv_heads)](mass, keep, mass.stride(0), mass.stride(1), keep.stride(0), keep.stride(1),
                                       nkb, qb0, float(threshold), TILE=tile, num_warps=4)
    idx, lo, hi = (torch.empty((nqb, nkb), dtype=torch.int32, device=dev) for _ in range(3))
    n_full, n_runs, diag, count = (torch.empty(nqb, dtype=torch.int32, device=dev) for _ in range(4))
    _runs_kernel[(nqb,)](keep, idx, lo, hi, n_full, n_runs, diag, count, keep.stride(0), keep.stride(1),
                         idx.stride(0), nkb, qb0, kv_heads, need, TILE=tile, num_warps=4)
    return BlockRuns(idx, lo, hi, n_full, n_runs, diag), count
