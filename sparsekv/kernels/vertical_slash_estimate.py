"""MInference's pattern estimate: column and diagonal attention mass of the last queries, fused.

vertical_slash_masses(q_last [L, H, D], k [Sk, KVH, D], softmax_scale, row0, exclude_columns)
    -> (col [H, Sk], diag [H, row0 + L])

The L query rows sit at positions row0 .. row0 + L - 1, key j at position j; row p sees the keys j <= p. With P the
causal softmax of the rows' scores (fp32), col[h, j] = sum_i P[h, i, j] (the "vertical" mass of key j) and
diag[h, d] = sum_i P[h, i, row0 + i - d] (the "slash" mass of offset d = position - key, 0 <= d < row0 + L).
exclude_columns [H, NV] (sorted key indices, e.g. the columns already selected as verticals) leaves those keys'
probabilities out of the diagonal masses, so that a strong column does not also rank the 64 diagonals it crosses.

Materialising P costs H * L * Sk fp32 (1 GiB for 32 heads, 64 rows and 128K keys) and several passes over it; the
kernels never write it:
  1. row statistics: one program per (head, key split) runs an online max / sum over its keys; the launcher
     merges the splits into each row's log-sum-exp (log2 units).
  2. masses: one program per (head, block of BLOCK_N offsets d0..d0+BLOCK_N-1). The keys those offsets touch for
     the L rows form one window of BLOCK_N + L - 1 keys ending at row0 - d0 + L - 1; one tl.dot gives the window's
     scores, exp2(s - lse) its probabilities p [L, WINDOW]. Row i's key on offset d0 + u is window column
     i + BLOCK_N - 1 - u, so a gather along the keys skews p into [L, BLOCK_N] and a row sum gives the block's
     diagonal masses. The first BLOCK_N window columns (keys row0 - d0 - BLOCK_N + 1 .. row0 - d0) are seen by
     every row and by no other program: their column sums are the column masses of those keys. The offset-0
     program also owns the keys after row0 (the rows' own causal triangle).
The reference is the same math in torch over the materialised scores.
"""
from __future__ import annotations

import math

import torch

from ._dispatch import HAS_TRITON, cdiv, jit, next_power_of_2, tl, triton_interpret, use_triton
from .attention import check_qkv

__all__ = ["vertical_slash_masses", "vertical_slash_masses_reference"]

LOG2E = 1.4426950408889634
GPU_BLOCK_N = 64  # offsets per mass program; the window is next_power_of_2(BLOCK_N + L - 1) keys
INTERPRET_BLOCK_N = 16
KEYS_PER_SPLIT = 4096  # keys per row-statistics program on the GPU
REFERENCE_ELEMENTS = 1 << 25  # fp32 scores the reference materialises at once


# ----------------------------------------------------------------------------------------- Triton kernels
@jit
def _load_rows(Q, head, rows, offs_d, row_ok, dim_ok, stride_qm, stride_qh, stride_qd):
    return tl.load(Q + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   mask=row_ok[:, None] & dim_ok[None, :], other=0.0)


@jit
def _row_stats_kernel(
    Q, K, M_OUT, L_OUT,
    stride_qm, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd, stride_mh, stride_ms,
    L, Sk, D, row0, keys_per_split, qk_scale,
    GROUP: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < L
    dim_ok = offs_d < D
    q = _load_rows(Q, head, rows, offs_d, row_ok, dim_ok, stride_qm, stride_qh, stride_qd)  # [BLOCK_L, BLOCK_D]
    k_base = K + (head // GROUP).to(tl.int64) * stride_kh
    pos = row0 + rows
    m_i = tl.full([BLOCK_L], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_L], dtype=tl.float32)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, tl.minimum(Sk, row0 + L))  # keys past the last row are never seen
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                    mask=(cols < hi)[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_L, BLOCK_N], log2 units
        s = tl.where((cols[None, :] <= pos[:, None]) & (cols < hi)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), 1)
        m_i = m_new
    out = head.to(tl.int64) * stride_mh + split * stride_ms + rows
    tl.store(M_OUT + out, m_i, mask=row_ok)
    tl.store(L_OUT + out, l_i, mask=row_ok)


@jit
def _masses_kernel(
    Q, K, LSE2, COL, DIAG, EXCLUDED,
    stride_qm, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd, stride_lh, stride_ch, stride_dh, stride_eh,
    L, Sk, D, row0, num_offsets, qk_scale,
    GROUP: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    BLOCK_D: tl.constexpr, EXCLUDE: tl.constexpr,
):
    head = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_N
    rows = tl.arange(0, BLOCK_L)
    offs_w = tl.arange(0, WINDOW)
    offs_u = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < L
    dim_ok = offs_d < D
    q = _load_rows(Q, head, rows, offs_d, row_ok, dim_ok, stride_qm, stride_qh, stride_qd)  # [BLOCK_L, BLOCK_D]
    lse2 = tl.load(LSE2 + head.to(tl.int64) * stride_lh + rows, mask=row_ok, other=float("inf"))  # [BLOCK_L]
    pos = row0 + rows
    keys = row0 - d0 - (BLOCK_N - 1) + offs_w  # [WINDOW] key of each window column
    key_ok = (keys >= 0) & (keys < Sk)
    k = tl.load(K + (head // GROUP).to(tl.int64) * stride_kh + keys[:, None].to(tl.int64) * stride_kn
                + offs_d[None, :] * stride_kd, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [WINDOW, BLOCK_D]
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_L, WINDOW], log2 units
    seen = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= pos[:, None])
    p = tl.where(seen, tl.exp2(s - lse2[:, None]), 0.0)  # [BLOCK_L, WINDOW]

    col = tl.sum(p, 0)  # [WINDOW]
    owned = key_ok & (offs_w < tl.where(d0 == 0, WINDOW, BLOCK_N))
    tl.store(COL + head.to(tl.int64) * stride_ch + keys, col, mask=owned)
    if EXCLUDE:  # the excluded columns' probabilities stay out of the diagonal masses
        excluded = tl.load(EXCLUDED + head.to(tl.int64) * stride_eh + keys, mask=key_ok, other=0)
        p = tl.where(excluded[None, :] != 0, 0.0, p)

    window_col = rows[:, None] + (BLOCK_N - 1) - offs_u[None, :]  # [BLOCK_L, BLOCK_N] in [0, BLOCK_L + BLOCK_N - 1)
    diag = tl.sum(tl.gather(p, window_col, axis=1), 0)  # [BLOCK_N]
    tl.store(DIAG + head.to(tl.int64) * stride_dh + d0 + offs_u, diag, mask=d0 + offs_u < num_offsets)


# ------------------------------------------------------------------------------------------- validation
def _check(q_last: torch.Tensor, k: torch.Tensor, row0: int) -> None:
    check_qkv(q_last, k, k)
    if isinstance(row0, bool) or not isinstance(row0, int) or row0 < 0:
        raise ValueError(f"row0 must be a non-negative int (position of the first query row); got {row0!r}")
    if q_last.device != k.device:
        raise ValueError(f"q_last is on {q_last.device} but k is on {k.device}: move both to one device")


# -------------------------------------------------------------------------------------------- reference
def _excluded_mask(exclude_columns: torch.Tensor | None, H: int, Sk: int, device) -> torch.Tensor | None:
    """[H, NV] key indices (out-of-range entries ignored) -> [H, Sk] int8, 1 on the excluded keys."""
    if exclude_columns is None:
        return None
    if exclude_columns.dim() != 2 or exclude_columns.shape[0] != H or exclude_columns.dtype.is_floating_point:
        raise ValueError(f"exclude_columns must be integer key indices [H={H}, N]; got {exclude_columns.dtype} "
                         f"{tuple(exclude_columns.shape)}")
    c = exclude_columns.to(device=device, dtype=torch.int64)
    mask = torch.zeros((H, Sk + 1), dtype=torch.int8, device=device)
    mask.scatter_(1, torch.where((c >= 0) & (c < Sk), c, Sk), 1)
    return mask[:, :Sk].contiguous()


def vertical_slash_masses_reference(q_last: torch.Tensor, k: torch.Tensor, softmax_scale: float, row0: int,
                                    exclude_columns: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch fp32 reference of vertical_slash_masses (materialises the scores a few heads at a time)."""
    _check(q_last, k, row0)
    excluded = _excluded_mask(exclude_columns, q_last.shape[1], k.shape[0], k.device)
    L, H, D = q_last.shape
    Sk, KVH, _ = k.shape
    group = H // KVH
    num_offsets = row0 + L
    col = torch.zeros((H, Sk), dtype=torch.float32, device=k.device)
    diag = torch.zeros((H, num_offsets), dtype=torch.float32, device=k.device)
    if L == 0 or Sk == 0:
        return col, diag
    pos = row0 + torch.arange(L, device=k.device)
    keys = torch.arange(Sk, device=k.device)
    unseen = keys[None, :] > pos[:, None]  # [L, Sk]
    step = max(1, REFERENCE_ELEMENTS // max(1, L * Sk))
    for h0 in range(0, H, step):
        heads = torch.arange(h0, min(H, h0 + step), device=k.device)
        qh = q_last[:, heads].float().transpose(0, 1)  # [h, L, D]
        kh = k[:, heads // group].float().permute(1, 2, 0)  # [h, D, Sk]
        s = (torch.matmul(qh, kh) * softmax_scale).masked_fill(unseen, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: 0
        col[heads] = p.sum(1)
        if excluded is not None:
            p = p.masked_fill(excluded[heads, None, :].bool(), 0.0)
        d = pos[:, None] - keys[None, :]  # [L, Sk] offset of each pair
        index = torch.where(unseen, num_offsets, d).expand(len(heads), -1, -1).reshape(len(heads), -1)
        sums = torch.zeros((len(heads), num_offsets + 1), dtype=torch.float32, device=k.device)
        diag[heads] = sums.scatter_add_(1, index, p.reshape(len(heads), -1))[:, :num_offsets]
    return col, diag


# ------------------------------------------------------------------------------------------- launcher
def _masses_triton(q_last, k, scale, row0, exclude_columns=None):
    L, H, D = q_last.shape
    Sk, KVH, _ = k.shape
    dev = k.device
    num_offsets = row0 + L
    block_l = max(16, next_power_of_2(L))
    block_d = max(16, next_power_of_2(D))
    block_n = INTERPRET_BLOCK_N if triton_interpret() else GPU_BLOCK_N
    seen_keys = min(Sk, num_offsets)
    per_split = max(block_n, 4 * block_n if triton_interpret() else KEYS_PER_SPLIT)
    splits = max(1, cdiv(seen_keys, per_split))
    qk_scale = scale * LOG2E
    m = torch.empty((H, splits, block_l), dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    _row_stats_kernel[(H, splits)](
        q_last, k, m, l, *q_last.stride(), *k.stride(), m.stride(0), m.stride(1),
        L, Sk, D, row0, per_split, qk_scale,
        GROUP=H // KVH, BLOCK_L=block_l, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4)
    m_max = m.amax(1, keepdim=True)
    m_safe = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
    total = (l * torch.exp2(m - m_safe)).sum(1)  # [H, block_l]
    lse2 = torch.where(total > 0, m_safe[:, 0] + torch.log2(total), torch.full_like(total, float("inf")))
    col = torch.zeros((H, Sk), dtype=torch.float32, device=dev)
    diag = torch.empty((H, num_offsets), dtype=torch.float32, device=dev)
    window = next_power_of_2(block_n + block_l - 1)
    excluded = _excluded_mask(exclude_columns, H, Sk, dev)
    excluded_arg = col if excluded is None else excluded  # a placeholder pointer when nothing is excluded
    _masses_kernel[(H, cdiv(num_offsets, block_n))](
        q_last, k, lse2, col, diag, excluded_arg, *q_last.stride(), *k.stride(), lse2.stride(0), col.stride(0),
        diag.stride(0), excluded_arg.stride(0), L, Sk, D, row0, num_offsets, qk_scale,
        GROUP=H // KVH, BLOCK_L=block_l, BLOCK_N=block_n, WINDOW=window, BLOCK_D=block_d,
        EXCLUDE=excluded is not None,
        num_warps=8 if window * block_l >= 8192 else 4)
    return col, diag


def vertical_slash_masses(q_last: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None,
                          row0: int | None = None, exclude_columns: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Column masses [H, Sk] and diagonal masses [H, row0 + L] (fp32) of the causal softmax of the L rows of
    q_last [L, H, D] (positions row0.., default: the last L of the keys) over k [Sk, KVH, D] (module docstring).
    Triton on CUDA (or on CPU under TRITON_INTERPRET=1), else the torch reference."""
    L, _, D = q_last.shape
    row0 = k.shape[0] - L if row0 is None else row0
    _check(q_last, k, row0)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if L == 0 or k.shape[0] == 0 or not (HAS_TRITON and use_triton(k.device)):
        return vertical_slash_masses_reference(q_last, k, scale, row0, exclude_columns)
    return _masses_triton(q_last, k, scale, row0, exclude_columns)
