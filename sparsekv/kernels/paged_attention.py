"""Decode attention (one query token per sequence) straight from a paged KV cache.

Flash-decoding: phase 1 runs a program per (sequence, kv head, split of the context) that
attends all H // KVH query heads of the GQA group at once; phase 2 merges the splits with their
log-sum-exps. With a single split phase 1 writes the final result and phase 2 is skipped.

Phase 2 runs inside the phase-1 launch: every split program writes its partial and bumps a per-(sequence,
kv head) arrival counter; the program that arrives last merges the group's partials and sets the counter back
to 0. The merge (:func:`_merge_group`: splits in a fixed order, elementwise fp32 accumulation) gives the same
bits whichever program arrives last; :func:`merge_splits` runs it as a kernel of its own for
sparsekv.kernels.decode_attention. The counters are one int32 buffer per device, made on the first launch
(:func:`split_counters`; the graph runners run every step eagerly before they capture it); every launch leaves
them at 0, so graph replays and eager calls share it. Launches that use it must not run concurrently on two
streams.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from ._dispatch import (
    INTERPRET, alloc_output, cdiv, choose_splits, default_kernels, exact_dot, jit, next_power_of_2,
    pdl_launch_options, pdl_wait, tl,
)
from .attention import SUPPORTED_HEAD_DIMS, flash_attn_with_lse_reference
from .attention_checks import check_paged_inputs

if TYPE_CHECKING:
    from .backend import KernelChoice

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "store_kv"]

LOG2E = 1.4426950408889634

BLOCK_N = 64  # tokens per inner step on GPU (16-bit, D <= 128; shrunk for bigger rows)
KV_TILE_BYTES = 16384  # BLOCK_N * D * element_size of one K (or V) tile at most
NUM_WARPS = 4
NUM_STAGES = 3
# One sequence (batch 1): wider tiles, 2 stages. tools/tune_decode_attention.py on an H100 (Qwen3-4B dims): 13.35 us
# per layer at 4K against 14.54 with the tiles above, level at 32K; at batch 8 the tiles above win.
SINGLE_SEQUENCE_TILE = (128, 32768, 2)  # (BLOCK_N, KV_TILE_BYTES, NUM_STAGES)
INTERPRET_BLOCK_N = 32
MIN_GROUP_ROWS = 16  # tl.dot needs >= 16 rows: the GQA group is padded up to this
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in merging than it saves
MAX_SPLITS = 128
PROGRAMS_PER_SM = 4  # target B * KVH * splits ~= PROGRAMS_PER_SM * num SMs
REDUCE_CHUNK = 16  # splits merged per (unrolled) step of the merge
COUNTER_SLOTS = 1 << 16  # arrival counters per device: B * KVH of one launch at most

_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


@jit
def _merge_group(
    OP, LP, O, L, b64, heads, h_ok,
    stride_opb, stride_oph, stride_ops, stride_opd,
    stride_lpb, stride_lph, stride_lps,
    stride_ob, stride_oh, stride_od, stride_lh, stride_lb,
    num_splits,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
):
    """Merge the partials of query heads `heads` [BLOCK_H] (valid where h_ok) of sequence b64: OP [B, H, S, D]
    fp32, LP [B, H, S] log2 units -> O [B, H, D], L [H, B] natural log. Splits are added one after another in
    split order with elementwise ops only (no tree reductions but the exact max), so the result does not depend
    on the launch shape, the layout the compiler picks, or which program runs it."""
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    lp = LP + b64 * stride_lpb + heads * stride_lph  # [BLOCK_H]
    op = OP + b64 * stride_opb + heads[:, None] * stride_oph + offs_d[None, :] * stride_opd  # [BLOCK_H, D]
    # .cg: the partials were just written by other SMs; read them from L2, never from a stale L1 line
    lse_all = tl.load(lp[:, None] + offs_s[None, :] * stride_lps,
                      mask=h_ok[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"),
                      cache_modifier=".cg")  # [BLOCK_H, BLOCK_S]
    m = tl.max(lse_all, 1)  # [BLOCK_H]; max is exact in any order
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros_like(m)  # [BLOCK_H]
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)  # [BLOCK_H, D]
    for s0 in range(0, num_splits, CHUNK):
        for j in tl.static_range(CHUNK):  # unrolled: the CHUNK loads of a step can all be in flight
            s = s0 + j
            s_ok = h_ok & (heads * 0 + s < num_splits)  # [BLOCK_H] (a tensor also under the interpreter)
            w = tl.exp2(tl.load(lp + s * stride_lps, mask=s_ok, other=float("-inf"),
                                cache_modifier=".cg") - m)  # [BLOCK_H]; 0 for empty or absent splits
            o = tl.load(op + s * stride_ops, mask=(w > 0.0)[:, None], other=0.0,
                        cache_modifier=".cg")  # [BLOCK_H, D]
            total += w
            acc += o * w[:, None]
    nonempty = total > 0.0
    t_safe = tl.where(nonempty, total, 1.0)
    tl.store(O + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             (acc / t_safe[:, None]).to(O.dtype.element_ty), mask=h_ok[:, None])
    lse = tl.where(nonempty, (m + tl.log2(t_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(L + heads * stride_lh + b64 * stride_lb, lse, mask=h_ok)


@jit
def _paged_decode_split_kernel(
    Q, K, V, BT, CTX, OP, LP, O, L, CNT, KS, VS, stride_sblk,
    stride_qb, stride_qh, stride_qd,
    stride_kblk, stride_kslot, stride_kh, stride_kd,
    stride_vblk, stride_vslot, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_opb, stride_oph, stride_ops, stride_opd,
    stride_lpb, stride_lph, stride_lps,
    stride_ob, stride_oh, stride_od, stride_lh, stride_lb,
    qk_scale, min_split, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
    SCALED: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # context lengths (and block tables) are copied in before the step's first kernel: read before the wait
    ctx = tl.load(CTX + b)
    # q and the step's own K/V come from the previous kernels
    pdl_wait(USE_PDL)
    # The sequence's own split plan: as many of the grid's num_splits as give each at least min_split keys. It
    # depends on ctx and the launch's constants only, so an eager step and a graph replay (whose grid is fixed by
    # max_model_len) split identically, and a short context still spreads over many programs.
    active = tl.maximum(tl.minimum(num_splits, tl.cdiv(ctx, min_split)), 1)
    split_len = tl.cdiv(tl.cdiv(ctx, active), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)  # splits >= active are empty

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
        if SCALED:  # fp8 pages, one scale per (page, kv head): dequantized here, on load
            k_scale = tl.load(KS + page * stride_sblk + kv_head, mask=t_ok, other=0.0)  # [BLOCK_N]
            v_scale = tl.load(VS + page * stride_sblk + kv_head, mask=t_ok, other=0.0)
            k = k.to(q.dtype)  # exact: fp8 fits in q's dtype; the scale goes on the scores
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            s = exact_dot(q, tl.trans(k), None) * (k_scale * qk_scale)[None, :]
        else:
            s = exact_dot(q, tl.trans(k), None) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: tok[0] < end is always valid
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + exact_dot(p.to(v.dtype), v, None)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]  # [BLOCK_G, D]; 0 for an empty split
    lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))  # log2 units
    if DIRECT:  # O = o [B, H, D], L = lse [H, B]
        tl.store(O + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=g_ok[:, None])
        tl.store(L + heads * stride_lh + b64 * stride_lb, lse2 * 0.6931471805599453, mask=g_ok)
    else:  # OP = partial o [B, H, S, D] fp32, LP = partial lse [B, H, S] (log2 units)
        tl.store(OP + b64 * stride_opb + heads[:, None] * stride_oph + split * stride_ops
                 + offs_d[None, :] * stride_opd, out, mask=g_ok[:, None])
        tl.store(LP + b64 * stride_lpb + heads * stride_lph + split * stride_lps, lse2, mask=g_ok)
        # Every thread's partial stores come before the (single-thread) release of the counter bump.
        tl.debug_barrier()
        cnt = CNT + b64 * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # the last program of the group: all partials are written
            offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
            _merge_group(OP, LP, O, L, b64, kv_head * GROUP + offs_h, offs_h < GROUP,
                         stride_opb, stride_oph, stride_ops, stride_opd,
                         stride_lpb, stride_lph, stride_lps,
                         stride_ob, stride_oh, stride_od, stride_lh, stride_lb,
                         active, BLOCK_H=BLOCK_H, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_S, CHUNK=CHUNK)
            tl.store(cnt, 0)  # ready for the next launch (and graph replay)


@jit
def _paged_decode_reduce_kernel(
    OP, LP, O, L,
    stride_opb, stride_oph, stride_ops, stride_opd,
    stride_lpb, stride_lph, stride_lps,
    stride_ob, stride_oh, stride_od, stride_lh, stride_lb,
    num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    b64 = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    _merge_group(OP, LP, O, L, b64, tl.program_id(1) * GROUP + offs_h, offs_h < GROUP,
                 stride_opb, stride_oph, stride_ops, stride_opd,
                 stride_lpb, stride_lph, stride_lps,
                 stride_ob, stride_oh, stride_od, stride_lh, stride_lb,
                 num_splits, BLOCK_H=BLOCK_H, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_S, CHUNK=CHUNK)


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
    softmax_scale: float | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch: gather each sequence's blocks (fp8 ones dequantized by their scales) and run the dense reference
    (Sq = 1)."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, scales)
    B, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    outs, lses = [], []
    for b, n in enumerate(context_lens.tolist()):
        blocks = block_tables[b, : -(-n // block_size)].long()
        k, v = k_cache[blocks], v_cache[blocks]  # [nb, block_size, KVH, D]
        if scales is not None:
            k, v = ((x.float() * s[blocks][:, None, :, None]).to(q.dtype) for x, s in zip((k, v), scales))
        k = k.reshape(-1, KVH, D)[:n]  # [n, KVH, D]
        v = v.reshape(-1, KVH, D)[:n]
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


def split_counters(device: torch.device, slots: int) -> torch.Tensor:
    """The device's int32 arrival counters of the fused reduce (all 0 between launches): made once, on the first
    launch (eager: graph runners run a step before they capture it), and kept for the process, since CUDA graphs
    captured later hold its address."""
    key = (device.type, device.index if device.type != "cuda" or device.index is not None
           else torch.cuda.current_device())
    if slots > COUNTER_SLOTS:
        raise ValueError(f"the fused paged decode needs B * KVH = {slots} arrival counters, more than "
                         f"COUNTER_SLOTS={COUNTER_SLOTS}: decode fewer sequences per step")
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                 group: int = 1, *, pdl: bool = False) -> None:
    """Phase 2 of flash-decoding: merge per-split partials o_part [B, H, S, D] fp32 and lse_part [B, H, S] fp32
    (log2 units, -inf for an empty split) into o [B, H, D] and lse [H, B] (natural log); one program per
    `group` heads of a sequence (the result does not depend on it)."""
    B, H, num_splits, D = o_part.shape
    if group < 1 or H % group:
        raise ValueError(f"merge_splits: group={group} must divide H={H} (o_part {tuple(o_part.shape)})")
    _paged_decode_reduce_kernel[(B, H // group)](
        o_part, lse_part, o, lse, *o_part.stride(), *lse_part.stride(), *o.stride(),
        *lse.stride(), num_splits, GROUP=group, BLOCK_H=next_power_of_2(group), HEAD_DIM=D,
        BLOCK_S=max(2, next_power_of_2(num_splits)), CHUNK=REDUCE_CHUNK, num_warps=NUM_WARPS,
        **pdl_launch_options(pdl))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
    softmax_scale: float | None = None, *,
    max_context_len: int | None = None, num_splits: int | None = None, min_split_tokens: int | None = None,
    kernels: KernelChoice | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a paged cache.

    q [B, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks]
    int32; context_lens [B] int32. Returns o [B, H, D] (q.dtype) and lse [H, B] fp32.
    ``max_context_len`` (>= context_lens.max(), known on the host) avoids a device sync;
    ``num_splits`` overrides the split heuristic (tests, tuning); ``kernels`` picks Triton (launched with PDL as
    it says) or the reference (default: the process default for q's device).
    Each sequence spreads its own context over at most that many splits of at least ``min_split_tokens`` keys
    (default: one tile), decided in the kernel from its length: a grid sized for a long max_context_len (a CUDA
    graph captured for max_model_len) still splits a short context evenly.
    ``scales`` (k_scale, v_scale [num_blocks, KVH] float32): the pages are fp8 (sparsekv.kernels.fp8_kv), key j of
    page p worth k_cache[p, j, h] * k_scale[p, h]; dequantized on load.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, scales)
    kernels = kernels if kernels is not None else default_kernels(q.device)
    if not kernels.triton:
        return paged_decode_attention_reference(
            q, k_cache, v_cache, block_tables, context_lens, softmax_scale, scales)
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
    stages = NUM_STAGES
    if INTERPRET:
        block_n = INTERPRET_BLOCK_N
    else:
        max_n, tile_bytes, stages = SINGLE_SEQUENCE_TILE if B == 1 else (BLOCK_N, KV_TILE_BYTES, NUM_STAGES)
        block_n = max(16, min(max_n, tile_bytes // (D * q.element_size())))
    if max_context_len is None:
        max_context_len = int(context_lens.max().item())
    if num_splits is None:
        num_splits = choose_num_splits(B, KVH, max_context_len, q.device)
    num_splits = max(1, int(num_splits))
    # the grid: no more splits than max_context_len fills with whole tiles (each sequence sizes its own in the kernel)
    split_len = cdiv(cdiv(max(max_context_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, cdiv(max_context_len, split_len))
    min_split = block_n if min_split_tokens is None else max(block_n, int(min_split_tokens))
    group = H // KVH
    pdl = pdl_launch_options(kernels.pdl)
    common = dict(GROUP=group, BLOCK_G=max(MIN_GROUP_ROWS, next_power_of_2(group)), HEAD_DIM=D,
                  PAGE_SIZE=page_size, BLOCK_N=block_n, BLOCK_H=next_power_of_2(group), CHUNK=REDUCE_CHUNK,
                  SCALED=scales is not None, num_warps=NUM_WARPS, num_stages=stages, **pdl)
    args = (q, k_cache, v_cache, block_tables, context_lens)
    scale_args = (q, q, 0) if scales is None else (*scales, scales[0].stride(0))
    strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride())
    out_strides = (*o.stride(), *lse.stride())
    grid = (B, KVH, num_splits)
    if num_splits == 1:
        _paged_decode_split_kernel[grid](
            *args, o, lse, o, lse, lse, *scale_args, *strides, 0, 0, 0, 0, 0, 0, 0, *out_strides,
            scale * LOG2E, min_split, num_splits, DIRECT=True, BLOCK_S=2, **common)
        return o, lse
    o_part = alloc_output((B, H, num_splits, D), torch.float32, q.device)  # [B, H, S, D]
    lse_part = alloc_output((B, H, num_splits), torch.float32, q.device)  # [B, H, S] log2
    counters = split_counters(q.device, B * KVH)  # [>= B * KVH] int32, all 0
    _paged_decode_split_kernel[grid](
        *args, o_part, lse_part, o, lse, counters, *scale_args, *strides, *o_part.stride(), *lse_part.stride(),
        *out_strides, scale * LOG2E, min_split, num_splits, DIRECT=False,
        BLOCK_S=max(2, next_power_of_2(num_splits)), **common)
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
