"""MInference's pattern estimate: column and diagonal attention mass of the last queries, fused.

vertical_slash_masses(q_last [L, H, D], k [Sk, KVH, D], softmax_scale, row0, exclude_columns, lse, offsets_from)
    -> (col [H, Sk], diag [H, row0 + L - offsets_from])
last_rows_lse(q_last, k, softmax_scale, row0) -> lse [H, L]

The L query rows sit at positions row0 .. row0 + L - 1, key j at position j; row p sees the keys j <= p. With P the
causal softmax of the rows' scores (fp32), col[h, j] = sum_i P[h, i, j] (the "vertical" mass of key j) and
diag[h, d - offsets_from] = sum_i P[h, i, row0 + i - d] (the "slash" mass of offset d = position - key, offsets_from
<= d < row0 + L). exclude_columns [H, NV] (sorted key indices, e.g. the columns already selected as verticals) leaves
those keys' probabilities out of the diagonal masses, so that a strong column does not also rank the 64 diagonals it
crosses. lse [H, L] (natural log) replaces the rows' own normaliser: P = exp(s - lse), e.g. the log-sum-exp over
another set of keys when the keys arrive in pieces; P is capped at 2^100 (keys more than 69 nats above that
normaliser count as 2^100), so such masses stay finite.

Materialising P costs H * L * Sk fp32 (1 GiB for 32 heads, 64 rows and 128K keys) and several passes over it; the
kernels never write it. Both run one program per (head, split of KEYS_PER_SPLIT keys), the head's L rows held in
registers, and walk the split's keys in tiles of BLOCK_K >= L keys (the programs of the GROUP heads that share a kv
head run next to each other, so their key tiles come from L2):
  1. row statistics (skipped when lse is given): online max / sum; the launcher merges the splits' partial sums into
     each row's log-sum-exp (log2 units).
  2. masses: one tl.dot per tile gives its scores, exp2(s - lse) its probabilities p [L, BLOCK_K], each (row, key)
     once. Column sums are the tile's column masses. Row i, key j0 + c lies on offset row0 - j0 - BLOCK_K + 1 + u
     with u = i + BLOCK_K - 1 - c in [0, 2 BLOCK_K): two gathers along the keys skew p into the halves u < BLOCK_K
     and u >= BLOCK_K, a row sum gives their diagonal masses, added to diag atomically. Consecutive tiles are
     BLOCK_K offsets apart, so each offset gets at most two additions onto zero: the sum is exact and the same in
     either order.
The reference is the same math in torch over the materialised scores.
"""
from __future__ import annotations

import math

import torch

from sparsekv.kernels._dispatch import (HAS_TRITON, cdiv, exact_dot, jit, next_power_of_2, tl, triton_interpret,
                                       use_triton)
from sparsekv.kernels.attention_checks import check_qkv

__all__ = ["last_rows_lse", "vertical_slash_masses", "vertical_slash_masses_reference"]

LOG2E = 1.4426950408889634
P_CAP_LOG2 = 100.0  # probabilities exp2(s - lse) are capped at 2^P_CAP_LOG2 (matters only with a foreign lse)
GPU_BLOCK_K = 64  # keys per tile (at least the padded row count)
INTERPRET_BLOCK_K = 16
KEYS_PER_SPLIT = 4096  # keys per program on the GPU
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
    L, D, row0, keys_hi, keys_per_split, qk_scale,
    GROUP: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_L)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < L
    dim_ok = offs_d < D
    q = _load_rows(Q, head, rows, offs_d, row_ok, dim_ok, stride_qm, stride_qh, stride_qd)  # [BLOCK_L, BLOCK_D]
    k_base = K + (head // GROUP).to(tl.int64) * stride_kh
    pos = row0 + rows
    m_i = tl.full([BLOCK_L], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_L], dtype=tl.float32)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, keys_hi)
    for start in range(lo, hi, BLOCK_K):
        cols = start + offs_k
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                    mask=(cols < hi)[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
        s = exact_dot(q, tl.trans(k), None) * qk_scale  # [BLOCK_L, BLOCK_K], log2 units
        s = tl.where((cols[None, :] <= pos[:, None]) & (cols < hi)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), 1)
        m_i = m_new
    out = head.to(tl.int64) * stride_mh + split * stride_ms + rows
    tl.store(M_OUT + out, m_i, mask=row_ok)
    tl.store(L_OUT + out, l_i, mask=row_ok)


@jit
def _skewed_sums(p, index, ok):
    # sum_i p[i, index[i, u]] where ok[i, u]: the diagonal masses of one half of the tile's offsets
    return tl.sum(tl.where(ok, tl.gather(p, index, axis=1), 0.0), 0)


@jit
def _masses_kernel(
    Q, K, LSE2, COL, DIAG, EXCLUDED,
    stride_qm, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd, stride_lh, stride_ch, stride_dh, stride_eh,
    L, D, row0, keys_hi, keys_per_split, offsets_from, num_offsets, qk_scale,
    GROUP: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    EXCLUDE: tl.constexpr, P_CAP: tl.constexpr,
):
    head = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_L)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < L
    dim_ok = offs_d < D
    q = _load_rows(Q, head, rows, offs_d, row_ok, dim_ok, stride_qm, stride_qh, stride_qd)  # [BLOCK_L, BLOCK_D]
    lse2 = tl.load(LSE2 + head.to(tl.int64) * stride_lh + rows, mask=row_ok, other=float("inf"))  # [BLOCK_L]
    k_base = K + (head // GROUP).to(tl.int64) * stride_kh
    col_base = COL + head.to(tl.int64) * stride_ch
    diag_base = DIAG + head.to(tl.int64) * stride_dh - offsets_from
    pos = row0 + rows
    # skew: row i, tile column c lies at u = i + BLOCK_K - 1 - c; the low half u < BLOCK_K, the high half the rest
    c_lo = rows[:, None] + (BLOCK_K - 1) - offs_k[None, :]  # [BLOCK_L, BLOCK_K] column of (i, u)
    ok_lo = c_lo < BLOCK_K  # c_lo >= 0 always (BLOCK_K >= BLOCK_L)
    c_hi = c_lo - BLOCK_K
    ok_hi = c_hi >= 0
    c_lo = tl.minimum(c_lo, BLOCK_K - 1)
    c_hi = tl.maximum(c_hi, 0)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, keys_hi)
    for j0 in range(lo, hi, BLOCK_K):
        keys = j0 + offs_k
        key_ok = keys < hi
        k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
        s = exact_dot(q, tl.trans(k), None) * qk_scale  # [BLOCK_L, BLOCK_K], log2 units
        seen = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= pos[:, None])
        p = tl.where(seen, tl.exp2(tl.minimum(s - lse2[:, None], P_CAP)), 0.0)  # [BLOCK_L, BLOCK_K]
        tl.store(col_base + keys, tl.sum(p, 0), mask=key_ok)
        if EXCLUDE:  # the excluded columns' probabilities stay out of the diagonal masses
            excluded = tl.load(EXCLUDED + head.to(tl.int64) * stride_eh + keys, mask=key_ok, other=0)
            p = tl.where(excluded[None, :] != 0, 0.0, p)
        d = row0 - j0 - (BLOCK_K - 1) + offs_k  # offset of u = 0 .. BLOCK_K - 1
        tl.atomic_add(diag_base + d, _skewed_sums(p, c_lo, ok_lo), mask=(d >= offsets_from) & (d < num_offsets))
        d = d + BLOCK_K
        tl.atomic_add(diag_base + d, _skewed_sums(p, c_hi, ok_hi), mask=(d >= offsets_from) & (d < num_offsets))


# ------------------------------------------------------------------------------------------- validation
def _check(q_last: torch.Tensor, k: torch.Tensor, row0: int, lse: torch.Tensor | None = None,
           offsets_from: int = 0) -> None:
    check_qkv(q_last, k, k)
    if isinstance(row0, bool) or not isinstance(row0, int) or row0 < 0:
        raise ValueError(f"row0 must be a non-negative int (position of the first query row); got {row0!r}")
    if q_last.device != k.device:
        raise ValueError(f"q_last is on {q_last.device} but k is on {k.device}: move both to one device")
    L, H, _ = q_last.shape
    if lse is not None and (lse.shape != (H, L) or lse.device != k.device):
        raise ValueError(f"lse must be [H={H}, L={L}] on {k.device}; got {tuple(lse.shape)} on {lse.device}")
    if isinstance(offsets_from, bool) or not isinstance(offsets_from, int) or not 0 <= offsets_from <= row0 + L:
        raise ValueError(f"offsets_from must be an int in [0, row0 + L = {row0 + L}]; got {offsets_from!r}")
    check_estimate_rows(L, q_last.shape[2], q_last.dtype, q_last.device, "q_last's rows")


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


def _reference_scores(q_last, k, scale, row0, heads):
    """fp32 scores [h, L, Sk] of the given q heads, -inf where a row does not see the key."""
    L, H, _ = q_last.shape
    group = H // k.shape[1]
    pos = row0 + torch.arange(L, device=k.device)
    unseen = torch.arange(k.shape[0], device=k.device)[None, :] > pos[:, None]  # [L, Sk]
    qh = q_last[:, heads].float().transpose(0, 1)  # [h, L, D]
    kh = k[:, heads // group].float().permute(1, 2, 0)  # [h, D, Sk]
    return (torch.matmul(qh, kh) * scale).masked_fill(unseen, float("-inf"))


def _head_steps(L: int, H: int, Sk: int, device):
    step = max(1, REFERENCE_ELEMENTS // max(1, L * Sk))
    for h0 in range(0, H, step):
        yield torch.arange(h0, min(H, h0 + step), device=device)


def last_rows_lse_reference(q_last: torch.Tensor, k: torch.Tensor, softmax_scale: float, row0: int) -> torch.Tensor:
    """Pure-torch fp32 reference of last_rows_lse."""
    _check(q_last, k, row0)
    L, H, _ = q_last.shape
    lse = torch.full((H, L), float("-inf"), dtype=torch.float32, device=k.device)
    if L and k.shape[0]:
        for heads in _head_steps(L, H, k.shape[0], k.device):
            lse[heads] = torch.logsumexp(_reference_scores(q_last, k, softmax_scale, row0, heads), dim=-1)
    return lse


def vertical_slash_masses_reference(q_last: torch.Tensor, k: torch.Tensor, softmax_scale: float, row0: int,
                                    exclude_columns: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                                    offsets_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch fp32 reference of vertical_slash_masses (materialises the scores a few heads at a time)."""
    _check(q_last, k, row0, lse, offsets_from)
    excluded = _excluded_mask(exclude_columns, q_last.shape[1], k.shape[0], k.device)
    L, H, D = q_last.shape
    Sk = k.shape[0]
    num_offsets = row0 + L
    col = torch.zeros((H, Sk), dtype=torch.float32, device=k.device)
    diag = torch.zeros((H, num_offsets - offsets_from), dtype=torch.float32, device=k.device)
    if L == 0 or Sk == 0:
        return col, diag
    pos = row0 + torch.arange(L, device=k.device)
    keys = torch.arange(Sk, device=k.device)
    unseen = keys[None, :] > pos[:, None]  # [L, Sk]
    for heads in _head_steps(L, H, Sk, k.device):
        s = _reference_scores(q_last, k, softmax_scale, row0, heads)
        if lse is None:
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: 0
        else:
            ref = lse[heads].float()[:, :, None]
            ref = torch.where(torch.isfinite(ref), ref, torch.full_like(ref, float("inf")))
            p = torch.exp2(torch.clamp((s - ref) * LOG2E, max=P_CAP_LOG2)).nan_to_num(0.0)
        col[heads] = p.sum(1)
        if excluded is not None:
            p = p.masked_fill(excluded[heads, None, :].bool(), 0.0)
        d = pos[:, None] - keys[None, :] - offsets_from  # [L, Sk] index of each pair's offset
        index = torch.where(unseen | (d < 0), num_offsets - offsets_from, d).expand(len(heads), -1, -1)
        sums = torch.zeros((len(heads), num_offsets - offsets_from + 1), dtype=torch.float32, device=k.device)
        sums.scatter_add_(1, index.reshape(len(heads), -1), p.reshape(len(heads), -1))
        diag[heads] = sums[:, :-1]
    return col, diag


def max_estimate_rows(head_dim: int, dtype: torch.dtype, device: torch.device) -> int | None:
    """The most query rows one estimate takes on `device`: the kernels hold the rows and as many keys in one tile,
    double-buffered in shared memory (2 x (rows + keys) x head_dim elements); None where nothing limits them (the
    torch reference, the interpreter)."""
    if device.type != "cuda" or not HAS_TRITON or triton_interpret() or not use_triton(device):
        return None
    limit = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    if not limit:
        return None
    block_d, itemsize, rows = max(16, next_power_of_2(head_dim)), torch.empty((), dtype=dtype).element_size(), 16
    while 2 * (2 * rows + max(2 * rows, GPU_BLOCK_K)) * block_d * itemsize <= limit:
        rows *= 2
    return rows


def check_estimate_rows(rows: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                        name: str = "the estimate's query rows") -> None:
    """A clear error, before any launch, for more rows than the device's shared memory holds."""
    most = max_estimate_rows(head_dim, dtype, device)
    if most is not None and rows > most:
        raise ValueError(f"{name}={rows}: the vertical-slash estimate holds that many query rows and as many keys in "
                         f"one shared-memory tile, and {torch.cuda.get_device_name(device)} fits at most {most} at "
                         f"head_dim {head_dim} in {dtype}; use {name} <= {most}")


# ------------------------------------------------------------------------------------------- launcher
def _blocks(L: int, D: int) -> tuple[int, int, int]:
    block_l = max(16, next_power_of_2(L))
    block_k = max(block_l, INTERPRET_BLOCK_K if triton_interpret() else GPU_BLOCK_K)
    return block_l, block_k, max(16, next_power_of_2(D))


def _split(keys_hi: int, block_k: int) -> tuple[int, int]:
    per_split = 4 * block_k if triton_interpret() else max(block_k, KEYS_PER_SPLIT // block_k * block_k)
    return per_split, max(1, cdiv(keys_hi, per_split))


def _row_lse2(q_last, k, qk_scale, row0) -> torch.Tensor:
    """[H, block_l] log2-unit log-sum-exp of each row (+inf for padding rows and rows that see no key)."""
    L, H, D = q_last.shape
    block_l, block_k, block_d = _blocks(L, D)
    keys_hi = min(k.shape[0], row0 + L)  # keys past the last row are never seen
    per_split, splits = _split(keys_hi, block_k)
    m = torch.empty((H, splits, block_l), dtype=torch.float32, device=k.device)
    l = torch.empty_like(m)
    _row_stats_kernel[(H, splits)](
        q_last, k, m, l, *q_last.stride(), *k.stride(), m.stride(0), m.stride(1),
        L, D, row0, keys_hi, per_split, qk_scale,
        GROUP=H // k.shape[1], BLOCK_L=block_l, BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4)
    m_max = m.amax(1, keepdim=True)
    m_safe = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
    total = (l * torch.exp2(m - m_safe)).sum(1)  # [H, block_l]
    return torch.where(total > 0, m_safe[:, 0] + torch.log2(total), torch.full_like(total, float("inf")))


def _masses_triton(q_last, k, scale, row0, exclude_columns=None, lse=None, offsets_from=0):
    L, H, D = q_last.shape
    Sk = k.shape[0]
    dev = k.device
    num_offsets = row0 + L
    block_l, block_k, block_d = _blocks(L, D)
    qk_scale = scale * LOG2E
    if lse is None:
        lse2 = _row_lse2(q_last, k, qk_scale, row0)
    else:
        lse2 = torch.full((H, block_l), float("inf"), dtype=torch.float32, device=dev)
        lse2[:, :L] = torch.where(torch.isfinite(lse), lse.float() * LOG2E, float("inf"))
    col = torch.zeros((H, Sk), dtype=torch.float32, device=dev)
    diag = torch.zeros((H, num_offsets - offsets_from), dtype=torch.float32, device=dev)
    keys_hi = min(Sk, num_offsets)  # keys past the last row are never seen
    per_split, splits = _split(keys_hi, block_k)
    excluded = _excluded_mask(exclude_columns, H, Sk, dev)
    excluded_arg = col if excluded is None else excluded  # a placeholder pointer when nothing is excluded
    _masses_kernel[(H, splits)](
        q_last, k, lse2, col, diag, excluded_arg, *q_last.stride(), *k.stride(), lse2.stride(0), col.stride(0),
        diag.stride(0), excluded_arg.stride(0), L, D, row0, keys_hi, per_split, offsets_from, num_offsets, qk_scale,
        GROUP=H // k.shape[1], BLOCK_L=block_l, BLOCK_K=block_k, BLOCK_D=block_d,
        EXCLUDE=excluded is not None, P_CAP=P_CAP_LOG2, num_warps=4)
    return col, diag


def _use_kernels(q_last: torch.Tensor, k: torch.Tensor) -> bool:
    return q_last.shape[0] > 0 and k.shape[0] > 0 and HAS_TRITON and use_triton(k.device)


def last_rows_lse(q_last: torch.Tensor, k: torch.Tensor, softmax_scale: float, row0: int) -> torch.Tensor:
    """Natural-log log-sum-exp [H, L] (fp32) of the causal scores of the rows q_last [L, H, D] (positions row0..)
    over k [Sk, KVH, D]; -inf for rows that see no key. Triton on CUDA (or the interpreter), else torch."""
    _check(q_last, k, row0)
    if not _use_kernels(q_last, k):
        return last_rows_lse_reference(q_last, k, softmax_scale, row0)
    lse2 = _row_lse2(q_last, k, float(softmax_scale) * LOG2E, row0)[:, :q_last.shape[0]]
    return torch.where(torch.isinf(lse2), float("-inf"), lse2 / LOG2E)


def vertical_slash_masses(q_last: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None,
                          row0: int | None = None, exclude_columns: torch.Tensor | None = None,
                          lse: torch.Tensor | None = None, offsets_from: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Column masses [H, Sk] and diagonal masses [H, row0 + L - offsets_from] (fp32, offsets offsets_from..) of
    the causal softmax of the L rows of q_last [L, H, D] (positions row0.., default: the last L of the keys) over
    k [Sk, KVH, D], normalised by lse [H, L] when given (module docstring). Triton on CUDA (or on CPU under
    TRITON_INTERPRET=1), else the torch reference."""
    L, _, D = q_last.shape
    row0 = k.shape[0] - L if row0 is None else row0
    _check(q_last, k, row0, lse, offsets_from)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if not _use_kernels(q_last, k):
        return vertical_slash_masses_reference(q_last, k, scale, row0, exclude_columns, lse, offsets_from)
    return _masses_triton(q_last, k, scale, row0, exclude_columns, lse, offsets_from)
