"""Decode attention (one query token per sequence) straight from a paged KV cache.

Flash-decoding: phase 1 runs a program per (sequence, kv head, split of the context) that
attends all H // KVH query heads of the GQA group at once; phase 2 merges the splits with their
log-sum-exps. With a single split phase 1 writes the final result and phase 2 is skipped.
"""

from __future__ import annotations

import math

import torch
from ._dispatch import (
    alloc_output, cdiv, choose_splits, jit, next_power_of_2, tl, triton_interpret, use_triton,
)
from .attention import SUPPORTED_HEAD_DIMS, flash_attn_with_lse_reference

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "store_kv"]

LOG2E = 1.4426950408889634

BLOCK_N = 64  # tokens per inner step on GPU (16-bit, D <= 128; shrunk for bigger rows)
KV_TILE_BYTES = 16384  # BLOCK_N * D * element_size of one K (or V) tile at most
NUM_WARPS = 4
NUM_STAGES = 3
INTERPRET_BLOCK_N = 32
MIN_GROUP_ROWS = 16  # tl.dot needs >= 16 rows: the GQA group is padded up to this
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in merging than it saves
MAX_SPLITS = 128
PROGRAMS_PER_SM = 4  # target B * KVH * splits ~= PROGRAMS_PER_SM * num SMs
REDUCE_CHUNK = 16  # splits merged per step of the reduce kernel


@jit
def _paged_decode_split_kernel(
    Q, K, V, BT, CTX, OP, LP,
    stride_qb, stride_qh, stride_qd,
    stride_kblk, stride_kslot, stride_kh, stride_kd,
    stride_vblk, stride_vslot, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_opb, stride_oph, stride_ops, stride_opd,
    stride_lpb, stride_lph, stride_lps,
    qk_scale, split_len, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX + b)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    end = tl.where(split == num_splits - 1, ctx, end)  # last split takes any overflow

    offs_g = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of this GQA group (padded)
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    g_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_ok[:, None], other=0.0)  # [BLOCK_G, D]
    k_base = K + kv_head.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
    v_base = V + kv_head.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd
    bt_row = BT + b64 * stride_btb

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n  # [BLOCK_N]
        t_ok = tok < end
        # Only table entries of used blocks are read: tok < end <= ctx.
        page = tl.load(bt_row + (tok // PAGE_SIZE) * stride_btn, mask=t_ok, other=0).to(tl.int64)
        slot = tok % PAGE_SIZE
        k = tl.load(k_base + page[:, None] * stride_kblk + slot[:, None] * stride_kslot,
                    mask=t_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_base + page[:, None] * stride_vblk + slot[:, None] * stride_vslot,
                    mask=t_ok[:, None], other=0.0)  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: tok[0] < end is always valid
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]  # [BLOCK_G, D]; 0 for an empty split
    lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))  # log2 units
    if DIRECT:  # OP = o [B, H, D], LP = lse [H, B]: stride_lph is its H, stride_lps its B stride
        tl.store(OP + b64 * stride_opb + heads[:, None] * stride_oph + offs_d[None, :] * stride_opd,
                 out.to(OP.dtype.element_ty), mask=g_ok[:, None])
        tl.store(LP + heads * stride_lph + b64 * stride_lps, lse2 * 0.6931471805599453, mask=g_ok)
    else:  # OP = partial o [B, H, S, D] fp32, LP = partial lse [B, H, S] (log2 units)
        tl.store(OP + b64 * stride_opb + heads[:, None] * stride_oph + split * stride_ops
                 + offs_d[None, :] * stride_opd, out, mask=g_ok[:, None])
        tl.store(LP + b64 * stride_lpb + heads * stride_lph + split * stride_lps, lse2, mask=g_ok)


@jit
def _paged_decode_reduce_kernel(
    OP, LP, O, L,
    stride_opb, stride_oph, stride_ops, stride_opd,
    stride_lpb, stride_lph, stride_lps,
    stride_ob, stride_oh, stride_od, stride_lh, stride_lb,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    offs_c = tl.arange(0, CHUNK)  # [CHUNK]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    lp = LP + b * stride_lpb + h * stride_lph
    lse_all = tl.load(lp + offs_s * stride_lps, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse_all, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse_all - m), 0)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    op = OP + b * stride_opb + h * stride_oph
    for s0 in range(0, num_splits, CHUNK):
        s_idx = s0 + offs_c
        s_ok = s_idx < num_splits
        w = tl.exp2(tl.load(lp + s_idx * stride_lps, mask=s_ok, other=float("-inf")) - m)
        o = tl.load(op + s_idx[:, None] * stride_ops + offs_d[None, :] * stride_opd,
                    mask=s_ok[:, None] & (w > 0.0)[:, None], other=0.0)  # [CHUNK, D]
        acc += tl.sum(o * w[:, None], 0)
    nonempty = total > 0.0
    t_safe = tl.where(nonempty, total, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d * stride_od,
             (acc / t_safe).to(O.dtype.element_ty))
    lse = tl.where(nonempty, (m + tl.log2(t_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(L + h * stride_lh + b * stride_lb, lse)


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [B, H, D] and k_cache/v_cache [num_blocks, block_size, KVH, D]; got q "
            f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    B, H, D = q.shape
    KVH = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"head dim mismatch: q {tuple(q.shape)} vs k_cache {tuple(k_cache.shape)}")
    if KVH == 0 or H % KVH != 0:
        raise ValueError(f"q heads H={H} (q {tuple(q.shape)}) must be a multiple of kv heads "
                         f"KVH={KVH} (k_cache {tuple(k_cache.shape)})")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"expected block_tables [B={B}, max_blocks_per_seq]; "
                         f"got {tuple(block_tables.shape)}")
    if tuple(context_lens.shape) != (B,):
        raise ValueError(f"expected context_lens [B={B}]; got {tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"expected {name} int32, got {t.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k_cache, v_cache must share one float dtype; got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch: gather each sequence's blocks and run the dense reference (Sq = 1)."""
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    outs, lses = [], []
    for b, n in enumerate(context_lens.tolist()):
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, KVH, D)[:n]  # [n, KVH, D]
        v = v_cache[blocks].reshape(-1, KVH, D)[:n]
        o, lse = flash_attn_with_lse_reference(q[b][None], k, v, softmax_scale, causal=False)
        outs.append(o[0])  # [H, D]
        lses.append(lse[:, 0])  # [H]
    if B == 0:
        return torch.empty_like(q), torch.empty((H, 0), dtype=torch.float32, device=q.device)
    return torch.stack(outs), torch.stack(lses, dim=1)


def choose_num_splits(batch: int, kv_heads: int, max_context_len: int,
                      device: torch.device) -> int:
    """Splits per (sequence, kv head) so that the grid fills the GPU for long contexts."""
    return choose_splits(batch * kv_heads, max_context_len, device, min_split_tokens=MIN_SPLIT_TOKENS,
                         programs_per_sm=PROGRAMS_PER_SM, max_splits=MAX_SPLITS)


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Phase 2 of flash-decoding: merge per-split partials o_part [B, H, S, D] fp32 and lse_part [B, H, S] fp32
    (log2 units, -inf for an empty split) into o [B, H, D] and lse [H, B] (natural log)."""
    B, H, num_splits, D = o_part.shape
    _paged_decode_reduce_kernel[(B, H)](
        o_part, lse_part, o, lse, *o_part.stride(), *lse_part.stride(), *o.stride(),
        *lse.stride(), num_splits, HEAD_DIM=D, BLOCK_S=max(2, next_power_of_2(num_splits)),
        CHUNK=REDUCE_CHUNK, num_warps=NUM_WARPS)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
    softmax_scale: float | None = None, *,
    max_context_len: int | None = None, num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a paged cache.

    q [B, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks]
    int32; context_lens [B] int32. Returns o [B, H, D] (q.dtype) and lse [H, B] fp32.
    ``max_context_len`` (>= context_lens.max(), known on the host) avoids a device sync;
    ``num_splits`` overrides the split heuristic (tests, tuning).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if not use_triton(q.device):
        return paged_decode_attention_reference(
            q, k_cache, v_cache, block_tables, context_lens, softmax_scale)
    B, H, D = q.shape
    page_size, KVH = k_cache.shape[1], k_cache.shape[2]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"paged decode supports head dims {SUPPORTED_HEAD_DIMS}; got D={D} "
                         f"(q {tuple(q.shape)})")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    o = alloc_output((B, H, D), q.dtype, q.device)  # [B, H, D]
    lse = alloc_output((H, B), torch.float32, q.device)  # [H, B]
    if B == 0:
        return o, lse
    if triton_interpret():
        block_n = INTERPRET_BLOCK_N
    else:
        block_n = max(16, min(BLOCK_N, KV_TILE_BYTES // (D * q.element_size())))
    if max_context_len is None:
        max_context_len = int(context_lens.max().item())
    if num_splits is None:
        num_splits = choose_num_splits(B, KVH, max_context_len, q.device)
    num_splits = max(1, int(num_splits))
    split_len = cdiv(cdiv(max(max_context_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, cdiv(max_context_len, split_len))
    group = H // KVH
    common = dict(GROUP=group, BLOCK_G=max(MIN_GROUP_ROWS, next_power_of_2(group)), HEAD_DIM=D,
                  PAGE_SIZE=page_size, BLOCK_N=block_n, num_warps=NUM_WARPS,
                  num_stages=NUM_STAGES)
    args = (q, k_cache, v_cache, block_tables, context_lens)
    strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride())
    grid = (B, KVH, num_splits)
    if num_splits == 1:
        _paged_decode_split_kernel[grid](
            *args, o, lse, *strides, o.stride(0), o.stride(1), 0, o.stride(2),
            0, lse.stride(0), lse.stride(1),
            scale * LOG2E, split_len, num_splits, DIRECT=True, **common)
        return o, lse
    o_part = alloc_output((B, H, num_splits, D), torch.float32, q.device)  # [B, H, S, D]
    lse_part = alloc_output((B, H, num_splits), torch.float32, q.device)  # [B, H, S] log2
    _paged_decode_split_kernel[grid](
        *args, o_part, lse_part, *strides, *o_part.stride(), *lse_part.stride(),
        scale * LOG2E, split_len, num_splits, DIRECT=False, **common)
    merge_splits(o_part, lse_part, o, lse)
    return o, lse


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v [N, KVH, D] into the paged caches at flat slots slot_mapping [N] (int64)."""
    if k.dim() != 3 or k.shape != v.shape or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected k/v [N, KVH, D] and caches [num_blocks, block_size, KVH, D]; "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k {tuple(k.shape)} does not match cache [.., .., KVH, D] "
                         f"{tuple(k_cache.shape)}")
    if tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(f"expected slot_mapping [N={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} != cache dtype {k_cache.dtype}")
    flat_shape = (-1, *k_cache.shape[2:])
    slots = slot_mapping.long()
    k_cache.view(flat_shape).index_copy_(0, slots, k)  # [num_blocks * block_size, KVH, D]
    v_cache.view(flat_shape).index_copy_(0, slots, v)
