"""Block-sparse flash attention that also returns the log-sum-exp of each row.

block_sparse_attention(q [n, H, D], k/v [S, KVH, D], block_idx [nqb, W], block_count [nqb], block_size,
                       softmax_scale, q_start) -> (o [n, H, D], lse [H, n] fp32)

Positions are absolute: query row i sits at position q_start + i (default q_start = S - n, the last n positions),
key j at position j. Blocks are `block_size` tokens from position 0; query block qb0 + r (qb0 = q_start //
block_size, r < nqb = ceil((q_start + n) / block_size) - qb0) attends to the key blocks block_idx[r, :block_count[r]]
(one list shared by every head), causally: key j is seen by query p iff j <= p and j < S. So the query block's own
(diagonal) block is masked causally and a listed block after it contributes nothing. Rows that see no key give
o = 0 and lse = -inf, so partial results merge exactly with merge_attention_outputs.

List conventions: block_idx is int32 (any integer dtype is accepted), each row sorted ascending without duplicates,
entries in [0, ceil(S / block_size)); entries past block_count[r] are padding and never read. block_lists_from_mask
builds (block_idx, block_count) from a boolean [nqb, nkb] selection on the device, without a host sync.

Triton kernel, one program per (BLOCK_M query rows inside one query block, head), online softmax over two loops:
  1. the listed blocks before the query block, BLOCK_N keys at a time: every key visible to every row, no mask;
  2. the listed blocks from the query block on (the diagonal): causal mask, keys past the rows' last position or
     past S skipped.
Each key tile is the dense kernel's step (attention._attn_block_step: the same tiles, fused exp2 scaling and TMA
loads of K/V where they run), so a kept tile costs what it costs in dense attention. The launcher counts the
entries before each query block on the device (no host sync). BLOCK_M and BLOCK_N divide block_size; head dims
outside attention.SUPPORTED_HEAD_DIMS, or a block_size without a power-of-two divisor >= 16, run the reference.
"""

from __future__ import annotations

import math

import torch
from ._dispatch import HAS_TRITON, alloc_output, cdiv, jit, tl, use_triton
from .attention import (
    SUPPORTED_HEAD_DIMS,
    TensorDescriptor,
    _attn_block_step,
    _empty_result,
    check_qkv,
    dense_tile_config,
    effective_attn_variants,
    masked_attention_rows,
)

__all__ = ["block_lists_from_mask", "block_sparse_attention", "block_sparse_attention_reference"]

LOG2E = 1.4426950408889634

# Tiles: attention.py's dense-kernel configs (timed there; sm_90 16-bit D=128: 128x128, 8 warps, 3 stages), with
# BLOCK_M and BLOCK_N cut to divide block_size. Of the dense kernel's compile-time variants (ATTN_VARIANTS) the two
# that apply per tile are used where they can run (effective_attn_variants): the scale fused into exp2, and K/V
# through TMA descriptors (sm_90+). Not yet timed as a block-sparse kernel.
VARIANTS: dict[str, bool] = {"FUSED_SCALE": True, "USE_TMA": True}
REFERENCE_CHUNK_ELEMENTS = 1 << 24  # [H, rows, S] scores the reference materialises at once
_SENTINEL = 1 << 30


# ----------------------------------------------------------------------------------------- Triton kernel
@jit
def _bsa_fwd_kernel(
    Q, K, V, O, LSE, IDX, COUNT, NFULL,
    stride_qm, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_om, stride_oh, stride_od,
    stride_lh, stride_lm, stride_ir,
    n, S, q_start, p_first, qk_scale,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    FUSED_SCALE: tl.constexpr, USE_TMA: tl.constexpr,
):
    # TILES = BLOCK_SIZE // BLOCK_N key tiles per block. With USE_TMA, K and V are TMA descriptors of [S, KVH * D]
    # views (q and o always move through pointers: the first query block may start before q_start).
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    first = p_first + pid_m * BLOCK_M  # absolute position of the program's first row
    pos = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] absolute query positions
    row_ok = (pos >= q_start) & (pos < q_start + n)
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    rows = (pos - q_start).to(tl.int64)  # rows of q / o

    q = tl.load(Q + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    kv_col = kv_head * HEAD_DIM
    if not USE_TMA:
        k_base = K + kv_head.to(tl.int64) * stride_kh + offs_n[:, None].to(tl.int64) * stride_kn \
            + offs_d[None, :] * stride_kd  # [BLOCK_N, D] pointers at key 0
        v_base = V + kv_head.to(tl.int64) * stride_vh + offs_n[:, None].to(tl.int64) * stride_vn \
            + offs_d[None, :] * stride_vd

    # this program's rows all lie in one query block (BLOCK_M divides BLOCK_SIZE): its row of the lists
    qb_row = (pid_m * BLOCK_M) // BLOCK_SIZE
    has_rows = (first + BLOCK_M > q_start) & (first < q_start + n)
    count = tl.where(has_rows, tl.load(COUNT + qb_row), 0)
    n_full = tl.where(has_rows, tl.load(NFULL + qb_row), 0)
    lst = IDX + qb_row.to(tl.int64) * stride_ir

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # ---- 1. blocks before the query block: every key visible to every row, no mask
    for it in range(0, n_full * TILES):
        start_n = tl.load(lst + it // TILES) * BLOCK_SIZE + (it % TILES) * BLOCK_N
        if USE_TMA:
            acc, m_i, l_i = _attn_block_step(
                acc, m_i, l_i, q, K, V, kv_col, start_n, pos, offs_n, S, 0, qk_scale,
                False, True, FUSED_SCALE, USE_TMA)
        else:
            acc, m_i, l_i = _attn_block_step(
                acc, m_i, l_i, q, k_base + start_n.to(tl.int64) * stride_kn, v_base + start_n.to(tl.int64) * stride_vn,
                kv_col, start_n, pos, offs_n, S, 0, qk_scale, False, True, FUSED_SCALE, USE_TMA)

    # ---- 2. the diagonal block (and any listed after it): causal mask, keys < S, tiles past the last row skipped.
    # Its first tile starts at or before every row's position, so no row meets a wholly masked tile first.
    last = tl.minimum(first + BLOCK_M, q_start + n)  # one past the program's last query position
    for e in range(n_full, count):
        lo = tl.load(lst + e) * BLOCK_SIZE
        hi = tl.minimum(tl.minimum(lo + BLOCK_SIZE, last), S)
        for t in range(0, tl.cdiv(hi - lo, BLOCK_N)):
            start_n = lo + t * BLOCK_N
            if USE_TMA:
                acc, m_i, l_i = _attn_block_step(
                    acc, m_i, l_i, q, K, V, kv_col, start_n, pos, offs_n, S, 0, qk_scale,
                    True, True, FUSED_SCALE, USE_TMA)
            else:
                acc, m_i, l_i = _attn_block_step(
                    acc, m_i, l_i, q, k_base + start_n.to(tl.int64) * stride_kn,
                    v_base + start_n.to(tl.int64) * stride_vn, kv_col, start_n, pos, offs_n, S, 0, qk_scale,
                    True, True, FUSED_SCALE, USE_TMA)

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_ptrs = O + head.to(tl.int64) * stride_oh + rows[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + head.to(tl.int64) * stride_lh + rows * stride_lm, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------- validation
def _layout(n: int, S: int, block_size: int, q_start: int) -> tuple[int, int]:
    """(qb0, nqb): the first query block and the number of query blocks."""
    qb0 = q_start // block_size
    return qb0, cdiv(q_start + n, block_size) - qb0


def _check_inputs(q, k, v, block_idx, block_count, block_size, q_start) -> int:
    """Validate; returns q_start (default S - n)."""
    check_qkv(q, k, v)
    n, S = q.shape[0], k.shape[0]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: must be an integer >= 1")
    if q_start is None:
        q_start = S - n
    if isinstance(q_start, bool) or not isinstance(q_start, int) or q_start < 0 or q_start + n > S:
        raise ValueError(f"q_start={q_start!r}: must be an int in [0, S - n] = [0, {S - n}] "
                         f"(q {tuple(q.shape)} sits inside k {tuple(k.shape)})")
    _, nqb = _layout(n, S, block_size, q_start)
    for name, t, dims in (("block_idx", block_idx, 2), ("block_count", block_count, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[0] != nqb:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            want = "[nqb, W]" if dims == 2 else "[nqb]"
            raise ValueError(f"expected {name} of shape {want} with nqb={nqb} query blocks of {block_size} tokens "
                             f"(q_start={q_start}, n={n}); got {shape}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers (int32), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return q_start


# -------------------------------------------------------------------------------------------- helpers
def block_lists_from_mask(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [nqb, nkb] bool -> (block_idx [nqb, nkb] int32: each row's kept key blocks ascending, then padding;
    block_count [nqb] int32). Device ops only: no host sync."""
    if not isinstance(keep, torch.Tensor) or keep.dim() != 2 or keep.dtype != torch.bool:
        shape = (tuple(keep.shape), keep.dtype) if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"expected keep as a bool tensor [nqb, nkb]; got {shape}")
    ids = torch.arange(keep.shape[1], dtype=torch.int32, device=keep.device)
    block_idx = torch.where(keep, ids, _SENTINEL).to(torch.int32).sort(dim=1).values
    return block_idx, keep.sum(dim=1, dtype=torch.int32)


def _block_mask(block_idx: torch.Tensor, block_count: torch.Tensor, nkb: int) -> torch.Tensor:
    """[nqb, nkb] bool of the listed blocks (padding and out-of-range entries ignored)."""
    idx = block_idx.long()
    listed = torch.arange(idx.shape[1], device=idx.device)[None, :] < block_count.long()[:, None]
    idx = torch.where(listed & (idx >= 0) & (idx < nkb), idx, nkb)
    mask = torch.zeros((idx.shape[0], nkb + 1), dtype=torch.bool, device=idx.device)
    mask.scatter_(1, idx, True)
    return mask[:, :nkb]


# -------------------------------------------------------------------------------------------- reference
def block_sparse_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, block_count: torch.Tensor,
    block_size: int, softmax_scale: float | None = None, q_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch fp32 reference: the dense (query, key) mask of the listed blocks, built over blocks of query rows
    so that at most REFERENCE_CHUNK_ELEMENTS scores exist at once. Returns o [n, H, D] (q.dtype), lse [H, n]."""
    q_start = _check_inputs(q, k, v, block_idx, block_count, block_size, q_start)
    n, H, D = q.shape
    S, KVH, _ = k.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if n == 0 or S == 0:
        return _empty_result(q)
    qb0, _ = _layout(n, S, block_size, q_start)
    blocks = _block_mask(block_idx, block_count, cdiv(S, block_size))  # [nqb, nkb]
    kf = k.float().transpose(0, 1).repeat_interleave(H // KVH, dim=0)  # [H, S, D]
    vf = v.float().transpose(0, 1).repeat_interleave(H // KVH, dim=0)  # [H, S, D]
    keys = torch.arange(S, device=q.device)
    rows = max(1, REFERENCE_CHUNK_ELEMENTS // max(1, H * S))
    o = torch.empty((n, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, n), dtype=torch.float32, device=q.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        pos = q_start + torch.arange(r0, r1, device=q.device)  # [r]
        mask = blocks[pos // block_size - qb0][:, keys // block_size] & (keys[None, :] <= pos[:, None])  # [r, S]
        part_o, lse[:, r0:r1] = masked_attention_rows(q[r0:r1], kf, vf, mask[None], scale)
        o[r0:r1] = part_o.to(q.dtype)
    return o, lse


# ------------------------------------------------------------------------------------------- launcher
def _config(q: torch.Tensor, block_size: int) -> tuple[int, int, int, int] | None:
    """Tile config (the dense kernel's for this dtype, head dim and GPU, cut to divide block_size), or None where
    the kernel does not apply (the reference runs)."""
    D = q.shape[2]
    if D not in SUPPORTED_HEAD_DIMS:
        return None
    block_m, block_n, warps, stages = dense_tile_config(q)
    divisor = block_size & -block_size  # the largest power of two dividing block_size
    block_m, block_n = min(block_m, divisor), min(block_n, divisor)
    if block_n < 16:
        return None
    return block_m, block_n, warps, stages


def _block_sparse_triton(q, k, v, block_idx, block_count, block_size, scale, q_start, config):
    n, H, D = q.shape
    S, KVH, _ = k.shape
    block_m, block_n, warps, stages = config
    qb0, nqb = _layout(n, S, block_size, q_start)
    idx = block_idx.to(torch.int32).contiguous()
    count = block_count.to(torch.int32).contiguous()
    # entries before each query block (no mask needed); sorted lists put them first
    qb = torch.arange(qb0, qb0 + nqb, dtype=torch.int32, device=q.device)
    listed = torch.arange(idx.shape[1], device=q.device)[None, :] < count[:, None]
    n_full = ((idx < qb[:, None]) & listed).sum(dim=1, dtype=torch.int32)
    if idx.shape[1] == 0:  # nothing listed anywhere: the kernel still needs a valid pointer
        idx = torch.zeros((nqb, 1), dtype=torch.int32, device=q.device)
    o = alloc_output((n, H, D), q.dtype, q.device)  # [n, H, D]
    lse = alloc_output((H, n), torch.float32, q.device)  # [H, n]
    flags = effective_attn_variants(q, k, v, o, scale, VARIANTS)
    ka, va = k, v
    if flags["USE_TMA"]:
        ka, va = (TensorDescriptor(t, [S, KVH * D], [t.stride(0), 1], [block_n, D]) for t in (k, v))
    _bsa_fwd_kernel[(cdiv(nqb * block_size, block_m), H)](
        q, ka, va, o, lse, idx, count, n_full,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(), idx.stride(0),
        n, S, q_start, qb0 * block_size, scale * LOG2E,
        GROUP=H // KVH, BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        TILES=block_size // block_n, FUSED_SCALE=flags["FUSED_SCALE"], USE_TMA=flags["USE_TMA"],
        num_warps=warps, num_stages=stages,
    )
    return o, lse


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, block_count: torch.Tensor,
    block_size: int, softmax_scale: float | None = None, q_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query blocks to their listed key blocks (see the module docstring).

    q [n, H, D] at positions q_start.. (default S - n), k/v [S, KVH, D], block_idx [nqb, W] sorted key blocks per
    query block, block_count [nqb] -> (o [n, H, D] in q.dtype, lse [H, n] fp32 natural log). Runs the Triton
    kernel on CUDA (or on CPU under TRITON_INTERPRET=1), else the reference. No host sync.
    """
    q_start = _check_inputs(q, k, v, block_idx, block_count, block_size, q_start)
    n, _, D = q.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if n == 0 or k.shape[0] == 0 or D == 0:
        return _empty_result(q)
    config = _config(q, block_size) if HAS_TRITON and use_triton(q.device) else None
    if config is None:
        return block_sparse_attention_reference(q, k, v, block_idx, block_count, block_size, scale, q_start)
    return _block_sparse_triton(q, k, v, block_idx, block_count, block_size, scale, q_start, config)
