"""XAttention's antidiagonal estimate of the attention mass per (KV head, query block, key block), fused.

xattn_block_mass(q [n, H, D], k [S, KVH, D], stride, block_size) -> mass [KVH, nqb, nkb] fp32

q are the last n positions of k (q_start = S - n); blocks are `block_size` tokens from position 0, nkb =
ceil(S / block_size) key blocks, nqb = nkb - q_start // block_size query blocks (those holding a query).
Definition (XAttentionPolicy.block_mass's, unchanged; the reference below): with strided rows i and columns j,
    score[h, i, j] = sum_t q[i*stride + stride-1-t, h] . k[j*stride + t, h // G] * D**-0.5 / stride
where a query position outside [q_start, S) or a key position >= S contributes a zero vector (a partial row or
column is scored over its real tokens; a column without any real key is never visible to a row with a real query);
softmax over the causally visible columns j <= i of each row; rows that hold no real query give 0;
mass[kvh, qb, kb] sums the softmax over the block's strided rows and columns and over the G query heads of the KV
head. Scores are fp32: the reference upcasts q and k (XAttentionPolicy.block_mass used to multiply in the input
dtype, rounding 16-bit scores to 16 bits), the kernel accumulates 16-bit products in fp32. On sm_89+ 16-bit q and k
are first copied to fp8 with one scale per (strided row, head) (strided_fp8; fp8=True asks for it elsewhere): every
score is one q row's tokens against one k column's, so the kernel multiplies the fp8 products' fp32 sum by the two
scales once per score tile, and the reference takes fp8=True to score the same copies.

Triton, two kernels, one matmul pass over the scores (the classic two-pass design recomputes them):
  1. _block_lse_kernel, one program per (head, tile of BLOCK_M strided rows, split of the row tile's column tiles):
     one flat loop over (column tile, offset t), so the loads stay pipelined from one column tile to the next; each
     [BLOCK_M, BLOCK_N] score tile is a sum of `stride` tl.dot products of [*, D] slices (no reshaped copies of q
     or k): on sm_90 through TMA descriptors of q and k viewed as [tokens / stride, stride * row] (view row i holds
     tokens i * stride ... i * stride + stride - 1, so offset t is a column offset), where the chunk starts on a
     block boundary and holds whole strides; elsewhere by strided pointer arithmetic (that variant is compiled at
     the first TMA call, so a prompt's ragged last chunk does not compile mid-prefill). At its last offset, per row
     and key block of the tile, the log2-sum-exp of the block's visible columns: lsb [H, rows, nkb] fp32 (BLOCK_N
     is a multiple of block_size / stride, so a tile holds whole key blocks). Column tiles above the causal
     diagonal or past the keys are not visited. The column tiles are split among programs only as far as a launch
     needs to reach PROGRAMS programs (long contexts, where the lsb budget leaves few rows per slice).
  2. _mass_kernel, one program per (query block, KV head): the row log-sum-exp over its key blocks (pass 1), then
     mass = sum over the group's heads and the block's valid rows of exp2(lsb - lse) (pass 2), written to every
     key block of the row (0 where invisible).
lsb costs H * rows * nkb * 4 bytes (8K queries, 128K keys, H = 32, stride 8: 128 MiB); longer chunks run in slices
of whole query blocks of at most LSB_ELEMENTS. block_size / stride must be a power of two of at most MAX_CELL
columns for the kernels; other layouts run the reference.
"""

from __future__ import annotations

import torch
from sparsekv.kernels._dispatch import (HAS_TRITON, alloc_output, cdiv, exact_dot, jit, next_power_of_2, tl,
                                       triton_interpret, use_triton)
from sparsekv.kernels.tma import TensorDescriptor, tma_device_ok, tma_view_ok
from sparsekv.policies.xattn.strided_fp8 import dequantize_strided, quantize_strided, quantize_strided_reference

__all__ = ["fp8_estimate_ok", "xattn_block_mass", "xattn_block_mass_reference"]

LOG2E = 1.4426950408889634
SCORE_ELEMENTS = 1 << 25  # fp32 strided scores the reference materialises at once
LSB_ELEMENTS = 1 << 25  # fp32 block log-sum-exps [H, rows, nkb] the kernels keep at once (128 MiB)
MAX_CELL = 128  # strided columns per key block (block_size / stride) the kernels handle
FP8_MIN_DOT_K = 32  # an fp8 tl.dot reduces over at least 32 elements: smaller head dims load zero-padded tiles

# (BLOCK_M strided rows, BLOCK_N strided columns, num_warps, num_stages) by head dim; the sm_90 row chosen by
# tools/tune_xattn.py --sections estimate (docs/decisions.md). With the TMA views (NVIDIA H200, Triton 3.6,
# 2026-11-29; an 8K-query chunk at the end of 128K / 512K keys, H=32 KVH=8 D=128 bf16, stride 8): (128, 128, 8, 3)
# 2.21 / 10.08 ms, (128, 128, 4, 3) 2.44 / 9.72, (64, 128, 4, 4) 2.41 / 10.25, (128, 256, 8, 2) 2.74 / 10.61; pointer
# loads at (128, 128, 8, 3) 2.88 / 12.94. Shared memory is stages x (BLOCK_M + BLOCK_N) x D x 2
# bytes: 144 KiB for 16-bit D=128 (fits sm_80's 163 KiB). The score tile is a GEMM tile with K = stride * D, so wider
# tiles read less per FLOP (BLOCK_M * BLOCK_N / (BLOCK_M + BLOCK_N) FLOP per byte): sm_90 (227 KiB) takes 128x128 in
# 3 stages (192 KiB).
GPU_CONFIG_16BIT = {64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (64, 64, 4, 2)}
GPU_CONFIG_16BIT_SM90 = {64: (128, 128, 8, 3), 128: (128, 128, 8, 3)}
# fp8 q and k (sm_89+; strided_fp8), chosen by the same tool: ms with the quantization of q and k (0.54 ms), 8K
# queries at the end of 512K keys (NVIDIA H200, 2026-11-29): (128, 256, 8, 3) 6.52, (128, 256, 8, 4) 6.38, (256, 128,
# 8, 4) 6.75, (64, 128, 4, 4) 7.15, (128, 128, 8, 4) 7.60; the 16-bit kernel 9.42 (128, 128, 8, 3). At 128K keys
# (128, 256, 8, 3) led as well (docs/decisions.md).
GPU_CONFIG_FP8_SM90 = {64: (128, 256, 8, 3), 128: (128, 256, 8, 3)}
GPU_CONFIG_FP32 = {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 1)}
INTERPRET_CONFIG = (16, 16, 4, 1)  # small tiles keep the CPU interpreter fast
MASS_TILE = 8192  # [group rows, key blocks] elements per step of _mass_kernel
PROGRAMS = 1056  # programs a launch aims for (8 per SM of an H100): column tiles are split among programs to reach it
MIN_SPLIT_TILES = 4  # column tiles a split keeps at least
_POINTER_VARIANTS_COMPILED: set[tuple] = set()  # estimate kernels compiled ahead for the pointer-load path


# ----------------------------------------------------------------------------------------- Triton kernels
# Triton compiles a variant per integer argument equal to 1 or divisible by 16; lengths and counts only bound loops
# and masks here (pointer alignment comes from the strides), so one compiled kernel serves every chunk of a prompt
# rather than a new one mid-prefill (a chunk whose tiles_per_split turns 16).
SHAPE_ARGS = ["n", "S", "q_start", "row0", "rows", "nkb", "ncols", "tiles_per_split", "q_view_row0", "sq_row0",
              "sq_rows"]


@jit(do_not_specialize=SHAPE_ARGS)
def _block_lse_kernel(
    Q, K, LSB, SQ, SK,
    stride_qm, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_lh, stride_lr, stride_sq, stride_sk,
    n, S, q_start, row0, rows, nkb, ncols, tiles_per_split, q_view_row0, sq_row0, sq_rows, qk_scale,
    STRIDE: tl.constexpr, CELL: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
    USE_TMA: tl.constexpr, SCALED: tl.constexpr,
):
    # USE_TMA: Q and K are TMA descriptors of the strided views [n / STRIDE, STRIDE * stride_qm] and
    # [S / STRIDE, STRIDE * stride_kn] (one view row holds STRIDE consecutive tokens, so k's strided column j at
    # offset t is view row j, column t * stride_kn + kv_head * D; q's rows take offset STRIDE - 1 - t); q_view_row0
    # is the slice's first row in q's view. Rows past a view's end read as zero, as the masked loads give.
    # SCALED: q and k are fp8 with one scale per strided row and head (strided_fp8): SQ [sq_rows, H] from strided
    # row sq_row0, SK [ncols, KVH]; a score tile is multiplied by its rows' and columns' scales after its last offset.
    head = tl.program_id(0)
    row_tile = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    local = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of this slice
    rows_abs = row0 + local  # absolute strided rows
    offs_d = tl.arange(0, BLOCK_D)
    dim_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    last_row = row0 + tl.minimum(row_tile * BLOCK_M + BLOCK_M, rows) - 1
    # this program's column tiles: its split's share of those at or below the causal diagonal and holding keys
    tile_end = tl.minimum(tl.minimum(last_row // BLOCK_N + 1, tl.cdiv(ncols, BLOCK_N)), (split + 1) * tiles_per_split)
    tile0 = split * tiles_per_split
    if not USE_TMA:
        q_base = Q + head.to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd
        k_base = K + kv_head.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
    if SCALED:
        sq_ok = (rows_abs >= sq_row0) & (rows_abs < sq_row0 + sq_rows)
        row_scale = tl.load(SQ + (rows_abs - sq_row0).to(tl.int64) * stride_sq + head, mask=sq_ok, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # one flat loop over (column tile, offset t): the loads stay pipelined across column tiles, and each tile's
    # epilogue runs at its last offset
    for it in range(0, tl.maximum(tile_end - tile0, 0) * STRIDE):
        t = it % STRIDE
        cols = (tile0 + it // STRIDE) * BLOCK_N + offs_n  # [BLOCK_N] absolute strided columns
        # q_r[i] = concat_t q[i*stride + stride-1-t], k_r[j] = concat_t k[j*stride + t]; missing tokens are 0
        if USE_TMA:
            qt = Q.load([q_view_row0 + row_tile * BLOCK_M,
                         (STRIDE - 1 - t) * stride_qm + head * D])  # [BLOCK_M, D]
            kt = K.load([(tile0 + it // STRIDE) * BLOCK_N, t * stride_kn + kv_head * D])  # [BLOCK_N, D]
        else:
            q_rows = rows_abs * STRIDE + (STRIDE - 1 - t) - q_start  # [BLOCK_M] rows of q
            q_ok = (q_rows >= 0) & (q_rows < n)
            qt = tl.load(q_base + q_rows[:, None].to(tl.int64) * stride_qm,
                         mask=q_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
            k_rows = cols * STRIDE + t  # [BLOCK_N] rows of k
            kt = tl.load(k_base + k_rows[:, None].to(tl.int64) * stride_kn,
                         mask=(k_rows < S)[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = exact_dot(qt, tl.trans(kt), acc)
        if t == STRIDE - 1:
            if SCALED:
                col_scale = tl.load(SK + cols.to(tl.int64) * stride_sk + kv_head, mask=cols < ncols, other=0.0)
                acc = acc * row_scale[:, None] * col_scale[None, :]
            s = tl.where(cols[None, :] <= rows_abs[:, None], acc * qk_scale, float("-inf"))  # log2 units, causal
            m = tl.max(s, 1)  # [BLOCK_M]
            m = tl.where(m == float("-inf"), 0.0, m)
            p = tl.exp2(s - m[:, None])
            cell_sum = tl.sum(tl.reshape(p, [BLOCK_M, BLOCK_N // CELL, CELL]), axis=2)  # [BLOCK_M, BLOCK_N // CELL]
            seen = cell_sum > 0.0
            lsb = tl.where(seen, m[:, None] + tl.log2(tl.where(seen, cell_sum, 1.0)), float("-inf"))
            kb = (tile0 + it // STRIDE) * (BLOCK_N // CELL) + tl.arange(0, BLOCK_N // CELL)
            ptrs = LSB + head.to(tl.int64) * stride_lh + local[:, None].to(tl.int64) * stride_lr + kb[None, :]
            tl.store(ptrs, lsb, mask=(local < rows)[:, None] & (kb < nkb)[None, :])
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@jit(do_not_specialize=["S", "q_start", "row0", "qb_first", "qb_out0", "nkb"])
def _mass_kernel(
    LSB, MASS,
    stride_lh, stride_lr, stride_mh, stride_mq,
    S, q_start, row0, qb_first, qb_out0, nkb,
    STRIDE: tl.constexpr, CELL: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_GR: tl.constexpr, BLOCK_KB: tl.constexpr,
):
    qb_local = tl.program_id(0)  # query block within the slice
    kv_head = tl.program_id(1)
    qb_abs = qb_first + qb_local
    idx = tl.arange(0, BLOCK_GR)  # (group head, row of the block) pairs
    g = idx // CELL
    local = qb_local * CELL + idx % CELL  # rows of the slice
    rows_abs = row0 + local
    row_ok = (idx < GROUP * CELL) & ((rows_abs + 1) * STRIDE > q_start) & (rows_abs * STRIDE < S)
    row_ptrs = LSB + (kv_head * GROUP + g).to(tl.int64) * stride_lh + local.to(tl.int64) * stride_lr
    offs_kb = tl.arange(0, BLOCK_KB)

    # pass 1: each row's log2-sum-exp over its visible key blocks 0..qb_abs
    m_i = tl.full([BLOCK_GR], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_GR], dtype=tl.float32)
    for kb0 in range(0, qb_abs + 1, BLOCK_KB):
        kb = kb0 + offs_kb
        ok = row_ok[:, None] & (kb <= qb_abs)[None, :]
        x = tl.load(row_ptrs[:, None] + kb[None, :], mask=ok, other=float("-inf"))  # [BLOCK_GR, BLOCK_KB]
        m_new = tl.maximum(m_i, tl.max(x, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(x - m_use[:, None]), 1)
        m_i = m_new
    lse = tl.where(row_ok & (l_i > 0.0), m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), 0.0)

    # pass 2: the softmax mass of every key block, summed over the group's rows; invisible blocks get 0
    out = MASS + kv_head.to(tl.int64) * stride_mh + (qb_abs - qb_out0).to(tl.int64) * stride_mq
    for kb0 in range(0, nkb, BLOCK_KB):
        kb = kb0 + offs_kb
        ok = row_ok[:, None] & (kb <= qb_abs)[None, :]
        x = tl.load(row_ptrs[:, None] + kb[None, :], mask=ok, other=float("-inf"))
        p = tl.where(ok, tl.exp2(x - lse[:, None]), 0.0)
        tl.store(out + kb, tl.sum(p, 0), mask=kb < nkb)


# ------------------------------------------------------------------------------------------- validation
def _check_inputs(q: torch.Tensor, k: torch.Tensor, stride: int, block_size: int) -> None:
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 3 or k.dim() != 3:
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in (q, k)]
        raise ValueError(f"expected q [n, H, D] and k [S, KVH, D]; got q {shapes[0]}, k {shapes[1]}")
    n, heads, dim = q.shape
    seq, kv_heads, kdim = k.shape
    if dim != kdim:
        raise ValueError(f"head dim mismatch: q {tuple(q.shape)} vs k {tuple(k.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q heads H={heads} must be a multiple of k heads KVH={kv_heads} "
                         f"(q {tuple(q.shape)}, k {tuple(k.shape)})")
    if n > seq:
        raise ValueError(f"q holds the last n positions of k, so n={n} must be <= S={seq} "
                         f"(q {tuple(q.shape)}, k {tuple(k.shape)})")
    if q.dtype != k.dtype or not q.dtype.is_floating_point:
        raise ValueError(f"q and k must share one floating dtype; got {q.dtype} and {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    for name, value in (("stride", stride), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if block_size % stride:
        raise ValueError(f"block_size={block_size} must be a multiple of stride={stride}")


def _layout(n: int, seq: int, block_size: int) -> tuple[int, int, int]:
    """(nkb, qb0, nqb): key blocks, first query block, query blocks."""
    nkb = cdiv(seq, block_size)
    qb0 = (seq - n) // block_size
    return nkb, qb0, nkb - qb0


# -------------------------------------------------------------------------------------------- reference
def xattn_block_mass_reference(q: torch.Tensor, k: torch.Tensor, stride: int, block_size: int,
                               fp8: bool = False) -> torch.Tensor:
    """Pure-torch reference of xattn_block_mass (the module docstring's definition): reshaped strided q/k, fp32
    scores in row slices of at most SCORE_ELEMENTS. fp8: of q and k through quantize_strided_reference and back.
    -> [KVH, nqb, nkb] fp32."""
    _check_inputs(q, k, stride, block_size)
    if fp8:
        q_start = k.shape[0] - q.shape[0]  # q holds the last positions of k
        q = dequantize_strided(*quantize_strided_reference(q, stride, q_start), stride, q_start)
        k = dequantize_strided(*quantize_strided_reference(k, stride, 0), stride, 0)
    n, heads, dim = q.shape
    seq, kv_heads, _ = k.shape
    group, bs = heads // kv_heads, block_size
    q_start = seq - n
    nkb, qb0, nqb = _layout(n, seq, bs)
    mass = torch.zeros(kv_heads, nqb, nkb, dtype=torch.float32, device=q.device)
    if n == 0 or dim == 0:
        return mass
    per_block = bs // stride  # strided rows/columns per block
    # keys padded to whole blocks, forward offsets concatenated: [KVH, nkb * per_block, stride * D]
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 scores (fp64 inputs stay fp64)
    kp = k.new_zeros(nkb * bs, kv_heads, dim, dtype=acc)
    kp[:seq] = k
    kr = kp.view(nkb * per_block, stride, kv_heads, dim).permute(2, 0, 1, 3).reshape(kv_heads, -1, stride * dim)
    # queries placed in their blocks, reversed offsets, scaled: [KVH, G, nqb * per_block, stride * D]
    qp = q.new_zeros(nqb * bs, heads, dim, dtype=acc)
    qp[q_start - qb0 * bs:q_start - qb0 * bs + n] = q.to(acc) * (dim ** -0.5 / stride)
    qr = qp.view(nqb * per_block, stride, heads, dim).flip(1).permute(2, 0, 1, 3)
    qr = qr.reshape(kv_heads, group, nqb * per_block, stride * dim)
    num_rows = nqb * per_block
    rows_abs = qb0 * per_block + torch.arange(num_rows, device=q.device)  # absolute strided row
    row_ok = ((rows_abs + 1) * stride > q_start) & (rows_abs * stride < seq)  # holds a real query
    cols = torch.arange(nkb * per_block, device=q.device)
    step = max(1, SCORE_ELEMENTS // max(1, heads * per_block * cols.numel())) * per_block
    for r0 in range(0, num_rows, step):
        r1 = min(r0 + step, num_rows)
        rows, c1 = r1 - r0, qb0 * per_block + r1  # columns past the slice's last row are invisible to it
        scores = torch.bmm(qr[:, :, r0:r1].reshape(kv_heads, group * rows, -1),
                           kr[:, :c1].transpose(1, 2)).view(kv_heads, group, rows, c1)  # [KVH, G, rows, c1]
        scores.masked_fill_(cols[None, :c1] > rows_abs[r0:r1, None], float("-inf"))  # causal (strided)
        p = torch.softmax(scores, dim=-1, dtype=torch.float32)
        p = p.view(kv_heads, group, rows, c1 // per_block, per_block).sum(dim=(1, 4))  # [KVH, rows, blocks]
        p = p * row_ok[r0:r1, None]
        mass[:, r0 // per_block:r1 // per_block, :c1 // per_block] = p.view(
            kv_heads, rows // per_block, per_block, -1).sum(dim=2)
    return mass


# ------------------------------------------------------------------------------------------- launcher
def use_strided_tma(q: torch.Tensor, k: torch.Tensor, stride: int, block_size: int) -> bool:
    """Whether the estimate can read q and k through TMA descriptors of their strided views: a TMA device, a
    power-of-two head dim, [S, heads * D] layouts, whole strides of tokens (n and S multiples of stride) and a
    chunk that starts on a block boundary (so no slice row lies before q's first token)."""
    n, seq, dim = q.shape[0], k.shape[0], q.shape[2]
    return (tma_device_ok(q.device) and dim >= 16 and dim & (dim - 1) == 0 and n >= stride
            and n % stride == 0 and (seq - n) % block_size == 0 and tma_view_ok(q) and tma_view_ok(k))


def strided_view_descriptor(t: torch.Tensor, stride: int, rows: int):
    """TMA descriptor of t [S, heads, D] as [S / stride, stride * t.stride(0)]: view row i holds tokens
    i * stride ... i * stride + stride - 1; boxes of [rows, D]."""
    width = stride * t.stride(0)
    return TensorDescriptor(t, [t.shape[0] // stride, width], [width, 1], [rows, t.shape[2]])


def fp8_estimate_ok(q: torch.Tensor) -> bool:
    """Whether the estimate multiplies fp8 copies of 16-bit q and k (strided_fp8): CUDA tensor cores with fp8
    (sm_89+) and the Triton kernels."""
    return (q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda" and HAS_TRITON
            and use_triton(q.device) and torch.cuda.get_device_capability(q.device) >= (8, 9))


def _config(q: torch.Tensor, cell: int, fp8: bool) -> tuple[int, int, int, int] | None:
    """Tile config for the kernels, or None where they do not apply (the reference runs)."""
    dim = q.shape[2]
    if cell & (cell - 1) or cell > MAX_CELL or dim > 256:
        return None
    if triton_interpret():
        block_m, block_n, warps, stages = INTERPRET_CONFIG
    else:
        sm90 = q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] >= 9
        table = GPU_CONFIG_FP32 if q.element_size() > 2 else GPU_CONFIG_16BIT
        if fp8 and sm90 and dim <= max(GPU_CONFIG_FP8_SM90):
            table = GPU_CONFIG_FP8_SM90
        elif q.element_size() <= 2 and dim <= max(GPU_CONFIG_16BIT_SM90) and sm90:
            table = GPU_CONFIG_16BIT_SM90
        block_m, block_n, warps, stages = next(table[d] for d in sorted(table) if dim <= d)
    if cell > block_n:  # a tile must hold whole key blocks: wider tiles, fewer rows and stages
        block_n, block_m, stages = cell, min(block_m, 64), min(stages, 2)
    return block_m, block_n, warps, stages


def _block_mass_triton(q: torch.Tensor, k: torch.Tensor, stride: int, block_size: int,
                       config: tuple[int, int, int, int], fp8: bool) -> torch.Tensor:
    n, heads, dim = q.shape
    seq, kv_heads, _ = k.shape
    block_m, block_n, warps, stages = config
    cell = block_size // stride
    q_start = seq - n
    nkb, qb0, nqb = _layout(n, seq, block_size)
    ncols = cdiv(seq, stride)  # strided columns holding a key
    mass = alloc_output((kv_heads, nqb, nkb), torch.float32, q.device)  # [KVH, nqb, nkb]
    if fp8:
        (q, q_scale), (k, k_scale) = quantize_strided(q, stride, q_start), quantize_strided(k, stride, 0)
    tma = use_strided_tma(q, k, stride, block_size) and (not fp8 or dim >= FP8_MIN_DOT_K)
    qa, ka = (strided_view_descriptor(q, stride, block_m), strided_view_descriptor(k, stride, block_n)) if tma \
        else (q, k)
    # slices of whole query blocks (and whole row tiles) so that lsb stays within LSB_ELEMENTS
    unit = max(block_m, cell)
    total_rows = nqb * cell
    slice_rows = min(cdiv(total_rows, unit) * unit, max(unit, LSB_ELEMENTS // max(1, heads * nkb) // unit * unit))
    # [H, rows, nkb]; only cells of visible (row, key block) pairs are written and read (poisoned in tests)
    lsb = alloc_output((heads, slice_rows, nkb), torch.float32, q.device)
    if not fp8:
        q_scale = k_scale = lsb  # unread
    block_gr = max(16, next_power_of_2(heads // kv_heads * cell))
    block_kb = max(16, min(128, MASS_TILE // block_gr))
    for s0 in range(0, total_rows, slice_rows):
        rows = min(slice_rows, total_rows - s0)
        row0 = qb0 * cell + s0  # absolute strided row of the slice's first row
        col_tiles = cdiv(min(ncols, row0 + rows), block_n)
        row_tiles = cdiv(rows, block_m)
        splits = max(1, min(col_tiles // MIN_SPLIT_TILES, cdiv(PROGRAMS, heads * row_tiles)))
        per_split = cdiv(col_tiles, splits)
        grid = (heads, row_tiles, cdiv(col_tiles, per_split))
        args = (lsb, q_scale, k_scale, *q.stride(), *k.stride(), lsb.stride(0), lsb.stride(1), q_scale.stride(0),
                k_scale.stride(0), n, seq, q_start, row0, rows, nkb, ncols, per_split, row0 - q_start // stride,
                q_start // stride, q_scale.shape[0], dim ** -0.5 / stride * LOG2E)
        constants = dict(STRIDE=stride, CELL=cell, GROUP=heads // kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_D=max(FP8_MIN_DOT_K if fp8 else 16, next_power_of_2(dim)), D=dim, SCALED=fp8,
                         num_warps=warps, num_stages=stages)
        _block_lse_kernel[grid](qa, ka, *args, USE_TMA=tma, **constants)
        variant = (q.device, q.dtype, dim, stride, cell, heads // kv_heads, config)
        if tma and variant not in _POINTER_VARIANTS_COMPILED and not triton_interpret():
            # a chunk that ends a prompt off the stride grid reads through pointers: compile that variant now, not
            # in the middle of a prefill
            _block_lse_kernel.warmup(q, k, *args, USE_TMA=False, grid=grid, **constants)
            _POINTER_VARIANTS_COMPILED.add(variant)
        _mass_kernel[(rows // cell, kv_heads)](
            lsb, mass, lsb.stride(0), lsb.stride(1), mass.stride(0), mass.stride(1),
            seq, q_start, row0, qb0 + s0 // cell, qb0, nkb,
            STRIDE=stride, CELL=cell, GROUP=heads // kv_heads, BLOCK_GR=block_gr, BLOCK_KB=block_kb,
            num_warps=4,
        )
    return mass


def xattn_block_mass(q: torch.Tensor, k: torch.Tensor, stride: int, block_size: int,
                     fp8: bool | None = None) -> torch.Tensor:
    """Antidiagonal block-mass estimate (see the module docstring).

    q [n, H, D] (the last n positions of k), k [S, KVH, D] -> [KVH, nqb, nkb] fp32 with nkb = ceil(S / block_size),
    nqb = nkb - (S - n) // block_size. Runs the Triton kernels on CUDA (or on CPU under TRITON_INTERPRET=1) when
    block_size / stride is a power of two <= MAX_CELL and D <= 256, else the reference. fp8 (None: fp8_estimate_ok)
    scores fp8 copies of q and k, one scale per strided row and head (strided_fp8). No host sync.
    """
    _check_inputs(q, k, stride, block_size)
    n, _, dim = q.shape
    fp8 = fp8_estimate_ok(q) if fp8 is None else fp8
    if n == 0 or dim == 0 or not (HAS_TRITON and use_triton(q.device)):
        return xattn_block_mass_reference(q, k, stride, block_size, fp8)
    config = _config(q, block_size // stride, fp8)
    if config is None:
        return xattn_block_mass_reference(q, k, stride, block_size, fp8)
    return _block_mass_triton(q, k, stride, block_size, config, fp8)
