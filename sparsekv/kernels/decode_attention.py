"""Attention of a few query rows (decode: Sq = 1) over contiguous K/V, flash-decoding style.

decode_attention(q [Sq, H, D], k/v [Sk, KVH, D]) returns exactly what flash_attn_with_lse returns:
o [Sq, H, D] (q.dtype) and lse [H, Sq] fp32 natural log, -inf (and o = 0) for rows that see no key;
causal masking is bottom-right aligned (query i sees key j iff j <= i + Sk - Sq).

The prefill kernel gives each (block of 128 query rows, query head) one program that walks all keys: at
Sq = 1 that is H programs, each reading its kv head's K/V once per query head of the GQA group. Here phase 1
runs one program per (tile of query rows, kv head, split of the keys): the tile packs the Sq * GROUP query
rows of one kv head (row r is query r // GROUP of head kv_head * GROUP + r % GROUP), padded to >= 16 rows
for tl.dot, so each K/V tile is read once for the whole group; phase 2 merges the splits by log-sum-exp
(paged_attention.merge_splits). With a single split phase 1 writes the final result.
K/V may be any strided view (last dim contiguous), e.g. a run of GPU ring slots ``k_slots[a:b].flatten(0, 1)``.
"""

from __future__ import annotations

import math

import torch
from ._dispatch import alloc_output, cdiv, choose_splits, jit, next_power_of_2, tl, triton_interpret, use_triton
from .attention import SUPPORTED_HEAD_DIMS, _empty_result, check_qkv, flash_attn_with_lse_reference
from .paged_attention import MIN_GROUP_ROWS, merge_splits

__all__ = ["decode_attention", "choose_num_splits"]

LOG2E = 1.4426950408889634

# Tuning constants (module globals read at each call, so sparsekv.kernels.bench can override them). Not yet timed
# on a GPU: starting values taken from the paged decode kernel.
BLOCK_N = 64  # keys per inner step on GPU (16-bit, D <= 128; shrunk for bigger rows)
KV_TILE_BYTES = 16384  # BLOCK_N * D * element_size of one K (or V) tile at most
NUM_WARPS = 4
NUM_STAGES = 3
INTERPRET_BLOCK_N = 32
MAX_TILE_ROWS = 64  # query rows (Sq * GROUP, padded) per program; more rows are spread over row tiles
MAX_TILE_ELEMS = 8192  # rows * D of the q tile (and of the fp32 accumulator) at most: 64 rows at D = 128
MIN_SPLIT_TOKENS = 128  # a split shorter than this costs more in merging than it saves
MAX_SPLITS = 128
PROGRAMS_PER_SM = 4  # target row_tiles * KVH * splits ~= PROGRAMS_PER_SM * num SMs


@jit
def _decode_split_kernel(
    Q, K, V, OP, LP,
    stride_qm, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_opm, stride_oph, stride_ops, stride_opd,
    stride_lpm, stride_lph, stride_lps,
    Sq, Sk, qk_scale, split_len,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, DIRECT: tl.constexpr,
):
    row_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = split * split_len
    end = tl.minimum(start + split_len, Sk)

    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] packed (query, head of the group) rows
    row_ok = rows < Sq * GROUP
    qi = rows // GROUP  # [BLOCK_R] query index
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_R] query head
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    q = tl.load(Q + qi[:, None].to(tl.int64) * stride_qm + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)  # [BLOCK_R, D]
    first = (start + offs_n)[:, None].to(tl.int64)  # [BLOCK_N, 1]
    k_ptrs = K + kv_head.to(tl.int64) * stride_kh + first * stride_kn + offs_d[None, :] * stride_kd  # [BLOCK_N, D]
    v_ptrs = V + kv_head.to(tl.int64) * stride_vh + first * stride_vn + offs_d[None, :] * stride_vd
    last_key = qi + (Sk - Sq)  # [BLOCK_R] causal: the last key each row sees

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n  # [BLOCK_N]
        t_ok = tok < end
        k = tl.load(k_ptrs, mask=t_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptrs, mask=t_ok[:, None], other=0.0)  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_R, BLOCK_N], log2 units
        if IS_CAUSAL:
            s = tl.where(t_ok[None, :] & (tok[None, :] <= last_key[:, None]), s, float("-inf"))
        else:
            s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # non-causal: finite, tok[0] < end is always valid
        if IS_CAUSAL:
            # Rows with nothing visible yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]  # [BLOCK_R, D]; 0 for rows that saw no key
    lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))  # log2 units
    if DIRECT:  # OP = o [Sq, H, D], LP = lse [H, Sq]: stride_lph is its H, stride_lpm its Sq stride
        tl.store(OP + qi[:, None] * stride_opm + heads[:, None] * stride_oph + offs_d[None, :] * stride_opd,
                 out.to(OP.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LP + heads * stride_lph + qi * stride_lpm, lse2 * 0.6931471805599453, mask=row_ok)
    else:  # OP = partial o [Sq, H, S, D] fp32, LP = partial lse [Sq, H, S] (log2 units)
        tl.store(OP + qi[:, None] * stride_opm + heads[:, None] * stride_oph + split * stride_ops
                 + offs_d[None, :] * stride_opd, out, mask=row_ok[:, None])
        tl.store(LP + qi * stride_lpm + heads * stride_lph + split * stride_lps, lse2, mask=row_ok)


def _tile_rows(rows: int, head_dim: int) -> int:
    """Query rows per program: all Sq * GROUP rows of a kv head when they fit, padded to >= 16 for tl.dot."""
    max_rows = max(MIN_GROUP_ROWS, min(MAX_TILE_ROWS, MAX_TILE_ELEMS // head_dim))
    return max(MIN_GROUP_ROWS, min(max_rows, next_power_of_2(rows)))


def choose_num_splits(row_tiles: int, kv_heads: int, seqlen_k: int, device: torch.device) -> int:
    """Splits of the keys per (row tile, kv head) so that the grid fills the GPU for long Sk."""
    return choose_splits(row_tiles * kv_heads, seqlen_k, device, min_split_tokens=MIN_SPLIT_TOKENS,
                         programs_per_sm=PROGRAMS_PER_SM, max_splits=MAX_SPLITS)


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                            num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel launch, unchecked: flash_attn_with_lse's Triton path calls this for small Sq after its checks.
    Needs Sq, Sk > 0 and D in SUPPORTED_HEAD_DIMS; ``num_splits`` overrides the split heuristic (tests, tuning)."""
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    group = H // KVH
    if triton_interpret():
        block_n = INTERPRET_BLOCK_N
    else:
        block_n = max(16, min(BLOCK_N, KV_TILE_BYTES // (D * q.element_size())))
    block_r = _tile_rows(Sq * group, D)
    row_tiles = cdiv(Sq * group, block_r)
    if num_splits is None:
        num_splits = choose_num_splits(row_tiles, KVH, Sk, q.device)
    num_splits = max(1, int(num_splits))
    split_len = cdiv(cdiv(Sk, num_splits), block_n) * block_n  # splits start on BLOCK_N boundaries
    num_splits = cdiv(Sk, split_len)
    o = alloc_output((Sq, H, D), q.dtype, q.device)  # [Sq, H, D]
    lse = alloc_output((H, Sq), torch.float32, q.device)  # [H, Sq]
    common = dict(GROUP=group, BLOCK_R=block_r, HEAD_DIM=D, BLOCK_N=block_n, IS_CAUSAL=bool(causal),
                  num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    args = (q, k, v)
    strides = (*q.stride(), *k.stride(), *v.stride())
    grid = (row_tiles, KVH, num_splits)
    if num_splits == 1:
        _decode_split_kernel[grid](
            *args, o, lse, *strides, o.stride(0), o.stride(1), 0, o.stride(2),
            lse.stride(1), lse.stride(0), 0,
            Sq, Sk, scale * LOG2E, split_len, DIRECT=True, **common)
        return o, lse
    o_part = alloc_output((Sq, H, num_splits, D), torch.float32, q.device)  # [Sq, H, S, D]
    lse_part = alloc_output((Sq, H, num_splits), torch.float32, q.device)  # [Sq, H, S] log2
    _decode_split_kernel[grid](
        *args, o_part, lse_part, *strides, *o_part.stride(), *lse_part.stride(),
        Sq, Sk, scale * LOG2E, split_len, DIRECT=False, **common)
    merge_splits(o_part, lse_part, o, lse)  # o [Sq, H, D] is its [B, H, D], lse [H, Sq] its [H, B]
    return o, lse


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    softmax_scale: float | None = None, causal: bool = False, *, num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_lse for few query rows: q [Sq, H, D], k/v [Sk, KVH, D] -> o [Sq, H, D], lse [H, Sq].

    Meant for Sq <= attention.DECODE_MAX_SQ (any Sq is correct). ``num_splits`` overrides the split heuristic.
    """
    check_qkv(q, k, v)
    Sq, H, D = q.shape
    Sk = k.shape[0]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if Sq == 0 or Sk == 0:
        return _empty_result(q)
    if not use_triton(q.device):
        return flash_attn_with_lse_reference(q, k, v, scale, causal)
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"triton decode attention supports head dims {SUPPORTED_HEAD_DIMS}; got D={D} "
                         f"(q {tuple(q.shape)})")
    return decode_attention_triton(q, k, v, scale, causal, num_splits)
