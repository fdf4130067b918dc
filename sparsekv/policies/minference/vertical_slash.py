"""Vertical-slash sparse attention (the MInference pattern) that also returns the log-sum-exp of each row.

vertical_slash_attention(q [Sq, H, D], k/v [Sk, KVH, D], vertical_idx [H, NV], slash_offsets [H, NS],
                         softmax_scale, q_offset, pair_counter=None) -> (o [Sq, H, D], lse [H, Sq] fp32)

Positions are absolute: query row i sits at position q_offset + i, key j at position j. Query p of head h
attends exactly to the union of
  * the vertical columns c in vertical_idx[h] that are causally visible (c <= p), and
  * the keys on the slash diagonals s in slash_offsets[h]: key p - s, when 0 <= p - s < Sk,
with one softmax over that union (a key hit by a column and a diagonal counts once). Rows that see no key
give o = 0 and lse = -inf, so partial results merge exactly with merge_attention_outputs.

Index conventions: both index tensors are sorted ascending per head (int32 preferred; any integer dtype is
accepted). Entries out of range (columns outside [0, Sk), offsets outside [0, q_offset + Sq)) are ignored,
so a caller pads ragged per-head selections with a large sentinel at the end. Duplicates are ignored.

Triton kernel, one program per (block of BLOCK_M query rows, head), online softmax over two loops:
  1. slash tiles: with BLOCK_M a multiple of BLOCK_N the offsets a [BLOCK_M, BLOCK_N] key tile covers depend only on
     its "block diagonal" t = (q_offset // BLOCK_N + (BLOCK_M // BLOCK_N) * m_block) - n_block, so sorted lists of
     the t whose tiles contain at least one selected offset serve every query block. Two lists, two loops without
     branches: tiles whose selected offsets form one run [lo, hi] (the recent band, whole 64-offset bands, single
     diagonals) keep the keys with lo <= offset <= hi, two comparisons; in the others the keys not on a selected
     diagonal are masked through the tile's selection bits: a tile spans BLOCK_M + BLOCK_N - 1 consecutive offsets
     (row i, key j sits on bit i + BLOCK_N - 1 - j of its window), packed into int64 words per (head, t), so the
     mask is a shift and an AND per score, no memory gather. The next list entry is loaded one iteration ahead so
     that the K/V loads can be software-pipelined.
  2. vertical columns: the selected columns are gathered BLOCK_N at a time by index (causally visible ones
     only: counted per query block), masking keys that lie on a selected diagonal of the row (added in loop 1):
     the bit of (row, column) in the window of the tile (query block, the column's key block), two word loads
     per column instead of a gathered byte per score (docs/decisions.md).
The lists, bits, run bounds and per-query-block ranges are built by vertical_slash_index.py beside this file (four
small Triton kernels and a zero fill; a torch reference there builds the same tensors).
The pure-torch reference builds the dense boolean mask [H, rows, Sk] block of rows by block of rows.

Pair count: with pair_counter (int64 [1] or [H]) the (query, key) pairs the attention adds to its softmaxes (a key
hit by a column and a diagonal once) are added to it, on either path, by vertical_slash_pair_count (pair_count.py
beside this file): a closed form over the index lists, no host sync. Counting inside the kernel cost 12% of its
time at 128K (docs/decisions.md).
"""

from __future__ import annotations

import math

import torch

from sparsekv.kernels._dispatch import (HAS_TRITON, alloc_output, exact_dot, jit, next_power_of_2, tl, triton_interpret,
                                       use_triton)
from sparsekv.kernels.attention import _empty_result, masked_attention_rows, online_softmax_step
from sparsekv.kernels.attention_checks import check_qkv
from .pair_count import vertical_slash_pair_count, visible_pair_count
from .vertical_slash_index import offset_range, slash_mask, vertical_slash_index

__all__ = ["vertical_slash_attention", "vertical_slash_attention_reference", "vertical_slash_pair_count",
           "visible_pair_count"]

LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by head dim; BLOCK_M must be a multiple of BLOCK_N. bf16 D=128 by
# tools/tune_vertical_slash.py on an H100: 64x32 with 4 warps beat 64x64 by 6-11% on 8K x 128K chunks and 128-row
# tiles were slower; 3 stages beat 2 by 1.6-2.4% in the engine's whole 128K prefill (--prefill; docs/decisions.md).
# Head dims 64 and 256 (the tool's --head-dim, every candidate on the three selections): 256's entry is the fastest
# on each, 64's within 1.7% of the best geometric mean, under the tool's run-to-run spread (docs/decisions.md, "The
# vertical-slash tiles at head dims 64 and 256"). fp32 by --fp32 (4K x 32K chunks, H100): 32x32 with 4 warps in two
# stages had the best geometric mean over the three selections at head dims 64, 128 and 256, 1.19x, 1.69x and 1.55x
# faster than the entries before (docs/decisions.md).
GPU_CONFIG_16BIT = {64: (64, 64, 4, 2), 128: (64, 32, 4, 3), 256: (64, 32, 4, 2)}
GPU_CONFIG_FP32 = {64: (32, 32, 4, 2), 128: (32, 32, 4, 2), 256: (32, 32, 4, 2)}
INTERPRET_CONFIG = (32, 16, 4, 1)  # small tiles keep the CPU interpreter fast; BLOCK_M = 2 BLOCK_N covers RATIO > 1
REFERENCE_CHUNK_ELEMENTS = 1 << 24  # [H, rows, Sk] scores the reference materialises at once


# ----------------------------------------------------------------------------------------- Triton kernel
@jit
def _online_softmax_step(acc, m_i, l_i, s, keep, v):
    # s [BLOCK_M, BLOCK_N] scores in log2 units; keep: which of them belong to the row's key set.
    return online_softmax_step(acc, m_i, l_i, tl.where(keep, s, float("-inf")), v, True)


@jit
def _kv_mask(row_ok, dim_ok, EVEN_D: tl.constexpr):
    # Without a mask along the head dim (BLOCK_D == D) loads and stores stay vectorised.
    if EVEN_D:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & dim_ok[None, :]
    return mask


@jit
def _slash_tiles(
    acc, m_i, l_i, q, pos, rows, offs_n, offs_d, dim_ok, k_base, v_base, words, bounds, tlist, t_lo, t_hi, tq,
    Sk, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
    BLOCK_N: tl.constexpr, LOOKUP: tl.constexpr, EVEN_D: tl.constexpr, NUM_WORDS: tl.constexpr,
):
    # key blocks n_block = tq - t for the entries t_lo..t_hi of the sorted t-list. The next entry is loaded
    # one iteration ahead, so the K/V addresses are loop-carried and the compiler can pipeline their loads.
    if LOOKUP:  # bit of (row i, key j) in the tile's offset window, and its word
        bit = (rows[:, None] + (BLOCK_N - 1) - offs_n[None, :]).to(tl.int64)  # rows: 0..BLOCK_M-1
        word = bit >> 6
        bit = bit & 63
    t = tl.load(tlist + t_lo, mask=t_lo < t_hi, other=0)
    for it in range(t_lo, t_hi):
        t_next = tl.load(tlist + it + 1, mask=it + 1 < t_hi, other=0)
        cols = (tq - t) * BLOCK_N + offs_n  # [BLOCK_N]
        col_ok = cols < Sk
        kv_mask = _kv_mask(col_ok, dim_ok, EVEN_D)
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        s = exact_dot(q, tl.trans(k), None) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        diag = pos[:, None] - cols[None, :]  # offset of each (row, key)
        if LOOKUP:  # scattered selection: keep the keys on a selected diagonal only
            w = tl.load(words + NUM_WORDS * t)
            for extra in tl.static_range(1, NUM_WORDS):
                w = tl.where(word == extra, tl.load(words + NUM_WORDS * t + extra), w)
            keep = col_ok[None, :] & (diag >= 0) & (((w >> bit) & 1) != 0)
        else:  # one run of selected offsets [lo, hi], lo >= 0 (so causal too)
            keep = col_ok[None, :] & (diag >= tl.load(bounds + 2 * t)) & (diag <= tl.load(bounds + 2 * t + 1))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, keep, v)
        t = t_next
    return acc, m_i, l_i


@jit
def _vs_fwd_kernel(
    Q, K, V, O, LSE,
    VIDX, WORDS, BOUNDS, TLIST_RUN, TLIST_PART, RANGES,
    stride_qm, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_om, stride_oh, stride_od,
    stride_lh, stride_lm,
    stride_vih, stride_wh, stride_bh, stride_tlh, stride_rh, stride_rm,
    Sq, Sk, D, q_offset, tq0, qk_scale,
    GROUP: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RATIO: tl.constexpr, NUM_WORDS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    row_ok = offs_m < Sq
    dim_ok = offs_d < D
    pos = q_offset + offs_m  # absolute query positions

    q_ptrs = Q + head.to(tl.int64) * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=_kv_mask(row_ok, dim_ok, EVEN_D), other=0.0)  # [BLOCK_M, BLOCK_D]
    k_base = K + kv_head.to(tl.int64) * stride_kh
    v_base = V + kv_head.to(tl.int64) * stride_vh
    words = WORDS + head.to(tl.int64) * stride_wh  # [NT, NUM_WORDS] selection bits of each tile's offset window
    bounds = BOUNDS + head.to(tl.int64) * stride_bh  # [NT, 2] first and last selected offset of each run tile

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # per (head, query block): [run lo, run hi, partial lo, partial hi, visible vertical count]
    ranges = RANGES + head.to(tl.int64) * stride_rh + pid_m * stride_rm
    tq = tq0 + RATIO * pid_m
    # ---- 1a. slash tiles whose selected offsets form one run: two comparisons per key
    acc, m_i, l_i = _slash_tiles(
        acc, m_i, l_i, q, pos, tl.arange(0, BLOCK_M), offs_n, offs_d, dim_ok, k_base, v_base, words, bounds,
        TLIST_RUN + head.to(tl.int64) * stride_tlh, tl.load(ranges), tl.load(ranges + 1), tq,
        Sk, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, BLOCK_N, False, EVEN_D, NUM_WORDS)
    # ---- 1b. slash tiles with scattered offsets selected: the tile's selection bits mask the keys
    acc, m_i, l_i = _slash_tiles(
        acc, m_i, l_i, q, pos, tl.arange(0, BLOCK_M), offs_n, offs_d, dim_ok, k_base, v_base, words, bounds,
        TLIST_PART + head.to(tl.int64) * stride_tlh, tl.load(ranges + 2), tl.load(ranges + 3), tq,
        Sk, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, BLOCK_N, True, EVEN_D, NUM_WORDS)

    # ---- 2. vertical columns visible to this query block, BLOCK_N at a time, minus those on a selected diagonal:
    # the window bits of the tile (this query block, the column's key block) say which (loop 1 added those)
    rows = tl.arange(0, BLOCK_M)
    v_cnt = tl.load(ranges + 4)
    vidx = VIDX + head.to(tl.int64) * stride_vih
    # (indices loaded one group ahead, as above)
    idx = tl.load(vidx + offs_n, mask=offs_n < v_cnt, other=-1)  # [BLOCK_N] key columns
    prev = tl.load(vidx + offs_n - 1, mask=(offs_n < v_cnt) & (offs_n > 0), other=-1)
    for start in range(0, v_cnt, BLOCK_N):
        e_next = start + BLOCK_N + offs_n
        idx_next = tl.load(vidx + e_next, mask=e_next < v_cnt, other=-1)
        prev_next = tl.load(vidx + e_next - 1, mask=e_next < v_cnt, other=-1)
        col_ok = (start + offs_n < v_cnt) & (idx != prev) & (idx >= 0) & (idx < Sk)
        kv_mask = _kv_mask(col_ok, dim_ok, EVEN_D)
        k = tl.load(k_base + idx[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + idx[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        s = exact_dot(q, tl.trans(k), None) * qk_scale
        diag = pos[:, None] - idx[None, :]
        key = tl.where(col_ok, idx, 0)
        key_block = key // BLOCK_N
        bit = (rows[:, None] + (BLOCK_N - 1) - (key - key_block * BLOCK_N)[None, :]).to(tl.int64)
        tile_words = words + NUM_WORDS * (tq - key_block)  # [BLOCK_N]
        w = tl.load(tile_words, mask=col_ok, other=0)[None, :]
        for extra in tl.static_range(1, NUM_WORDS):
            w = tl.where((bit >> 6) == extra, tl.load(tile_words + extra, mask=col_ok, other=0)[None, :], w)
        keep = col_ok[None, :] & (diag >= 0) & (((w >> (bit & 63)) & 1) == 0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, keep, v)
        idx = idx_next
        prev = prev_next

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_ptrs = O + head.to(tl.int64) * stride_oh + offs_m[:, None].to(tl.int64) * stride_om \
        + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=_kv_mask(row_ok, dim_ok, EVEN_D))
    tl.store(LSE + head.to(tl.int64) * stride_lh + offs_m * stride_lm, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------- validation
def _check_inputs(q, k, v, vertical_idx, slash_offsets, q_offset) -> None:
    check_qkv(q, k, v)
    H = q.shape[1]
    for name, idx in (("vertical_idx", vertical_idx), ("slash_offsets", slash_offsets)):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != H:
            shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"expected {name} of shape [H, N] with H={H} (q {tuple(q.shape)}); got {shape}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer indices (int32), got {idx.dtype}")
        if idx.device != q.device:
            raise ValueError(f"{name} is on {idx.device} but q is on {q.device}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"q_offset must be a non-negative int (position of q's first row); got {q_offset!r}")


def _vertical_mask(vertical_idx: torch.Tensor, Sk: int) -> torch.Tensor:
    """Dense [H, Sk] bool of the selected columns."""
    H = vertical_idx.shape[0]
    c = vertical_idx.long()
    idx = torch.where((c >= 0) & (c < Sk), c, Sk)
    mask = torch.zeros((H, Sk + 1), dtype=torch.bool, device=c.device)
    mask.scatter_(1, idx, True)
    return mask[:, :Sk]


# -------------------------------------------------------------------------------------------- reference
def vertical_slash_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    vertical_idx: torch.Tensor, slash_offsets: torch.Tensor,
    softmax_scale: float | None = None, q_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch fp32 reference: dense boolean mask and masked softmax, built over blocks of query rows so
    that at most REFERENCE_CHUNK_ELEMENTS scores exist at once. Returns o [Sq, H, D] (q.dtype), lse [H, Sq]."""
    _check_inputs(q, k, v, vertical_idx, slash_offsets, q_offset)
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if Sq == 0 or Sk == 0:
        return _empty_result(q)
    group = H // KVH
    d_lo, d_hi = offset_range(Sq, Sk, q_offset)
    width = d_hi - d_lo
    on_slash = torch.cat([slash_mask(slash_offsets, d_lo, d_hi).bool(),
                          torch.zeros((H, 1), dtype=torch.bool, device=q.device)], dim=1)  # [H, width+1]
    vertical = _vertical_mask(vertical_idx, Sk)  # [H, Sk]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, Sk, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, Sk, D]
    keys = torch.arange(Sk, device=q.device)
    rows = max(1, REFERENCE_CHUNK_ELEMENTS // max(1, H * Sk))
    o = torch.empty((Sq, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, Sq), dtype=torch.float32, device=q.device)
    for r0 in range(0, Sq, rows):
        r1 = min(Sq, r0 + rows)
        pos = q_offset + torch.arange(r0, r1, device=q.device)
        diag = pos[:, None] - keys[None, :]  # [r, Sk]
        causal = diag >= 0
        slot = torch.where(causal & (diag >= d_lo) & (diag < d_hi), diag - d_lo, width)
        mask = causal & (on_slash[:, slot] | vertical[:, None, :])  # [H, r, Sk]
        part_o, lse[:, r0:r1] = masked_attention_rows(q[r0:r1], kf, vf, mask, scale)
        o[r0:r1] = part_o.to(q.dtype)
    return o, lse


# ------------------------------------------------------------------------------------------- launcher
def _config(q: torch.Tensor) -> tuple[int, int, int, int]:
    if triton_interpret():
        return INTERPRET_CONFIG
    D = q.shape[2]
    table = GPU_CONFIG_FP32 if q.element_size() > 2 else GPU_CONFIG_16BIT
    for dim in sorted(table):
        if D <= dim:
            return table[dim]
    raise ValueError(f"vertical_slash_attention supports head dims up to 256; got D={D} (q {tuple(q.shape)})")


def _vertical_slash_triton(q, k, v, vertical_idx, slash_offsets, scale, q_offset):
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    block_m, block_n, warps, stages = _config(q)
    index = vertical_slash_index(vertical_idx, slash_offsets, Sq, Sk, q_offset, block_m, block_n)
    g = index.geometry
    block_d = max(16, next_power_of_2(D))
    o = alloc_output((Sq, H, D), q.dtype, q.device)
    lse = alloc_output((H, Sq), torch.float32, q.device)
    _vs_fwd_kernel[(g.num_m, H)](
        q, k, v, o, lse,
        index.vidx, index.words, index.bounds, index.tlists[0], index.tlists[1], index.ranges,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        index.vidx.stride(0), index.words.stride(0), index.bounds.stride(0),
        index.tlists.stride(1), index.ranges.stride(0), index.ranges.stride(1),
        Sq, Sk, D, q_offset, g.t0, scale * LOG2E,
        GROUP=H // KVH, BLOCK_D=block_d, EVEN_D=block_d == D,
        BLOCK_M=block_m, BLOCK_N=block_n, RATIO=block_m // block_n, NUM_WORDS=index.words.shape[2],
        num_warps=warps, num_stages=stages,
    )
    return o, lse


def _check_counter(pair_counter: torch.Tensor | None, H: int, device: torch.device) -> None:
    if pair_counter is None:
        return
    if not isinstance(pair_counter, torch.Tensor) or pair_counter.dtype != torch.int64 \
            or tuple(pair_counter.shape) not in ((1,), (H,)):
        got = (tuple(pair_counter.shape), pair_counter.dtype) if isinstance(pair_counter, torch.Tensor) \
            else type(pair_counter).__name__
        raise ValueError(f"pair_counter must be an int64 tensor of shape [1] or [H={H}]; got {got}")
    if pair_counter.device != device:
        raise ValueError(f"pair_counter is on {pair_counter.device} but q is on {device}")


def vertical_slash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    vertical_idx: torch.Tensor, slash_offsets: torch.Tensor,
    softmax_scale: float | None = None, q_offset: int = 0, pair_counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention over selected columns and diagonals (see the module docstring).

    q [Sq, H, D] at positions q_offset.., k/v [Sk, KVH, D] at positions 0..Sk-1, vertical_idx [H, NV] and
    slash_offsets [H, NS] sorted integer tensors -> (o [Sq, H, D] in q.dtype, lse [H, Sq] fp32 natural log).
    pair_counter: optional int64 tensor [1] or [H] on q's device; the computed (query, key) pairs (all heads, or
    per head) are added to it on the device, vertical_slash_pair_count's number, without a host sync.
    Runs the Triton kernel on CUDA (or on CPU under TRITON_INTERPRET=1), else the reference.
    """
    _check_inputs(q, k, v, vertical_idx, slash_offsets, q_offset)
    Sq, H, D = q.shape
    Sk = k.shape[0]
    _check_counter(pair_counter, H, q.device)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if Sq == 0 or Sk == 0 or D == 0:
        return _empty_result(q)
    if HAS_TRITON and use_triton(q.device):
        out = _vertical_slash_triton(q, k, v, vertical_idx, slash_offsets, scale, q_offset)
    else:
        out = vertical_slash_attention_reference(q, k, v, vertical_idx, slash_offsets, scale, q_offset)
    if pair_counter is not None:
        pairs = vertical_slash_pair_count(Sq, Sk, q_offset, vertical_idx, slash_offsets)  # [H]
        pair_counter += pairs if pair_counter.shape[0] == H else pairs.sum()
    return out
