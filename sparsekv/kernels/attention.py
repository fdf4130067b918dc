"""Prefill/chunk attention that also returns the log-sum-exp of each query row.

flash_attn_with_lse(q [Sq, H, D], k/v [Sk, KVH, D]) -> (o [Sq, H, D], lse [H, Sq] fp32).
Causal masking is bottom-right aligned: query i sees key j iff j <= i + (Sk - Sq).
Rows that see no key give o = 0 and lse = -inf, so partial results merge exactly.
"""

from __future__ import annotations

import math

import torch
from typing import TYPE_CHECKING

from ._dispatch import (INTERPRET, alloc_output, attention_backend, cdiv, default_kernels, exact_dot, jit,
                        tl)
from .attention_checks import check_qkv
from .attention_sm90 import flash_attn_sm90, sm90_attention_ok
from .external_attention import flash_attn_package, torch_fused_attention
from .tma import TensorDescriptor, use_tma

if TYPE_CHECKING:
    from .backend import KernelChoice

__all__ = ["flash_attn_with_lse", "flash_attn_with_lse_reference"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim for 16-bit inputs, picked by timing on
# H200 (same sm_90 SM as H100), Triton 3.6, Sq = Sk = 4096, H = 32, KVH = 8.
GPU_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    16: (128, 64, 4, 3),
    32: (128, 64, 4, 3),
    64: (128, 64, 4, 3),
    128: (128, 64, 8, 3),
    256: (128, 64, 8, 2),
}
# Hopper (sm_90: 227 KiB of shared memory per SM) fits 128x128 tiles in 3 stages (224 KiB): with the scale fused
# into exp2 and TMA loads they timed 1.15-2.2x faster than (128, 64, 8, 3) on an H100 (2026-11-22).
# Chosen by tools/tune_prefill_attention.py (rerun it to change this table), NVIDIA H200, Triton 3.6, 2026-11-26,
# H=32 KVH=8 D=128 bf16, TFLOP/s of (128, 128, 8, 3) against the next config (cuDNN / SDPA flash):
#   32K causal 547 vs 512 (128x64 w8 s4; 515 in heavy-first order) (594 / 346);
#   128K causal 503-507 vs 479 (128x64 w8 s4; 510 in heavy-first order, within noise) (563 / 324);
#   4Kx32K non-causal chunk 568 vs 525 (128x64 w8 s4) (605 / 350). See docs/decisions.md, "Prefill attention".
# Again 2026-11-29 (--finalists 1), with the sm90 Gluon kernel (heaviest query blocks first) beside it: 32K causal
# 547 vs 515 (128x64 w8 s3) (sm90 gluon 634, cuDNN 597, SDPA flash 346); 128K causal 511 (621 / 564 / 326); chunk
# 548 (636 / 614 / 349). On an H100 80GB HBM3, 2026-12-07: 32K causal 563 vs 529 (128x64 w8 s3) (sm90 gluon 653,
# cuDNN 617, SDPA flash 350); 128K causal 513 (626 / 567 / 324); chunk 578 (641 / 608 / 358). With the Gluon kernel on
# named barriers (H100, 2026-12-07): 32K causal 559 vs 532 (128x64 w8 s3) (sm90 gluon 642, cuDNN 624, SDPA flash
# 350); 128K causal 513 (643 / 577 / 326); chunk 584 (639 / 632 / 359).
GPU_CONFIGS_SM90: dict[int, tuple[int, int, int, int]] = {128: (128, 128, 8, 3)}
# fp32 inputs need twice the shared memory per tile (not a hot path: smaller tiles).
GPU_CONFIGS_FP32: dict[int, tuple[int, int, int, int]] = {
    16: (64, 64, 4, 2),
    32: (64, 64, 4, 2),
    64: (64, 64, 4, 2),
    128: (64, 32, 4, 2),
    256: (32, 32, 4, 2),
}
INTERPRET_CONFIG = (16, 16, 4, 1)  # small blocks keep the CPU interpreter fast
SUPPORTED_HEAD_DIMS = tuple(GPU_CONFIGS)

# _flash_fwd_kernel scales the scores inside the exp2 argument (one FMA per score; needs softmax_scale > 0) and, on
# sm_90+ with TMA-compatible layouts, moves q/k/v/o through host-side TMA descriptors ([S, heads * D] views, see
# tma.py); a call that cannot use either runs the plain code for it (see _launch_flash_fwd).
# On sm_90 a 16-bit call with D = 128 and TMA-compatible layouts runs the warp-specialized Gluon kernel of
# attention_sm90.py instead (681 against 567 TFLOP/s at 32K causal in one run on an H100, docs/benchmarks.md); these
# tables serve the rest.
# Calls with at most this many query rows (decode: 1) run the flash-decoding kernel of decode_attention.py, which
# splits the keys over many programs and reads each K/V tile once per GQA group, instead of _flash_fwd_kernel's
# ceil(Sq / BLOCK_M) * H programs that each walk all keys.
DECODE_MAX_SQ = 16


@jit
def _attn_block_step(
    acc, m_i, l_i, q, k_src, v_src, kv_col, start_n, offs_m, offs_n, Sk, causal_off, qk_scale,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, FUSED_SCALE: tl.constexpr, USE_TMA: tl.constexpr,
):
    # One key block. k_src/v_src: [BLOCK_N, D] pointer blocks, or (USE_TMA) [Sk, KVH * D] descriptors read at
    # column kv_col. acc [BLOCK_M, D] fp32; m_i, l_i [BLOCK_M] fp32 (running max in log2 units, row sum).
    if MASKED:
        cols = start_n + offs_n  # [BLOCK_N]
    if USE_TMA:
        k = k_src.load([start_n, kv_col])  # [BLOCK_N, D]; rows >= Sk read as zero
        v = v_src.load([start_n, kv_col])
    elif MASKED:
        k = tl.load(k_src, mask=cols[:, None] < Sk, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_src, mask=cols[:, None] < Sk, other=0.0)
    else:
        k = tl.load(k_src)
        v = tl.load(v_src)
    if FUSED_SCALE:
        # Raw scores; the scale goes into the exp2 argument (one FMA per score) and needs qk_scale > 0.
        s = exact_dot(q, tl.trans(k), None)  # [BLOCK_M, BLOCK_N]
        if MASKED:
            keep = cols[None, :] < Sk
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_off)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if MASKED:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        acc = exact_dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + tl.sum(p, 1)
    else:
        s = exact_dot(q, tl.trans(k), None) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            keep = cols[None, :] < Sk
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_off)
            s = tl.where(keep, s, float("-inf"))
        acc, m_new, l_i = online_softmax_step(acc, m_i, l_i, s, v, MASKED)
    return acc, m_new, l_i


@jit
def online_softmax_step(acc, m_i, l_i, s, v, SHIFT_EMPTY_ROWS: tl.constexpr):
    """One flash-attention update: scores s [M, N] (log2 units, -inf where masked) and values v [N, D] folded into
    acc [M, D], running max m_i [M] and row sum l_i [M]. Returns (acc, m_new, l_i). SHIFT_EMPTY_ROWS: rows that
    have seen no key yet keep m = -inf and are shifted by 0 so exp2 gives 0, not NaN (needed whenever masking can
    hide a whole tile from a row)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if SHIFT_EMPTY_ROWS:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + exact_dot(p.to(v.dtype), v, None)
    return acc, m_new, l_i


@jit
def _attn_block_loop(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, kv_col, offs_m, offs_n,
    lo, hi, Sk, causal_off, stride_kn, stride_vn, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    FUSED_SCALE: tl.constexpr, USE_TMA: tl.constexpr,
):
    # acc [BLOCK_M, D] fp32; m_i, l_i [BLOCK_M] fp32 (running max in log2 units, row sum).
    # k_ptrs/v_ptrs: [BLOCK_N, D] pointer blocks at key 0, or (USE_TMA) the K/V descriptors.
    if not USE_TMA:
        k_ptrs += lo * stride_kn
        v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attn_block_step(
            acc, m_i, l_i, q, k_ptrs, v_ptrs, kv_col, start_n, offs_m, offs_n, Sk, causal_off, qk_scale,
            MASKED, IS_CAUSAL, FUSED_SCALE, USE_TMA)
        if not USE_TMA:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return acc, m_i, l_i


@jit
def causal_key_bounds(start_m, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """For the query rows [start_m, start_m + BLOCK_M) (bottom-right causal alignment): keys [0, full_hi) are
    visible to every row and need no mask (full_hi a multiple of BLOCK_N), keys [full_hi, hi) are partly visible,
    keys >= hi to none. Returns (causal_off = Sk - Sq, full_hi, hi)."""
    causal_off = Sk - Sq
    if IS_CAUSAL:
        hi = tl.maximum(tl.minimum(Sk, start_m + BLOCK_M + causal_off), 0)
        full_hi = tl.maximum(tl.minimum(Sk, start_m + causal_off + 1), 0)
    else:
        hi = Sk
        full_hi = Sk
    return causal_off, (full_hi // BLOCK_N) * BLOCK_N, hi


@jit
def _flash_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qm, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_om, stride_oh, stride_od,
    stride_lh, stride_lm,
    Sq, Sk, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    FUSED_SCALE: tl.constexpr, USE_TMA: tl.constexpr,
):
    # With USE_TMA, Q/K/V/O are TMA descriptors of [S, heads * D] views.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]

    kv_col = kv_head * HEAD_DIM
    if USE_TMA:
        q = Q.load([start_m, head * HEAD_DIM])  # [BLOCK_M, D]; rows >= Sq read as zero
        k_ptrs = K
        v_ptrs = V
    else:
        q_ptrs = Q + head.to(tl.int64) * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm \
            + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=offs_m[:, None] < Sq, other=0.0)  # [BLOCK_M, D]
        k_ptrs = K + kv_head.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn \
            + offs_d[None, :] * stride_kd  # [BLOCK_N, D]
        v_ptrs = V + kv_head.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn \
            + offs_d[None, :] * stride_vd

    causal_off, full_hi, hi = causal_key_bounds(start_m, Sq, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = _attn_block_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, kv_col, offs_m, offs_n, 0, full_hi, Sk, causal_off,
        stride_kn, stride_vn, qk_scale, BLOCK_N, False, IS_CAUSAL, FUSED_SCALE, USE_TMA)
    acc, m_i, l_i = _attn_block_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, kv_col, offs_m, offs_n, full_hi, hi, Sk, causal_off,
        stride_kn, stride_vn, qk_scale, BLOCK_N, True, IS_CAUSAL, FUSED_SCALE, USE_TMA)

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row_ok = offs_m < Sq
    if USE_TMA:
        O.store([start_m, head * HEAD_DIM], out.to(q.dtype))  # o has q's dtype; rows >= Sq are not written
    else:
        o_ptrs = O + head.to(tl.int64) * stride_oh + offs_m[:, None].to(tl.int64) * stride_om \
            + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + head.to(tl.int64) * stride_lh + offs_m * stride_lm, lse, mask=row_ok)


def effective_attn_variants(q, k, v, o, scale: float, variants: dict[str, bool] | None = None) -> dict[str, bool]:
    """The per-tile code paths a call can use, for kernels that share _attn_block_step
    (sparsekv.kernels.block_sparse_attention): FUSED_SCALE where scale > 0, USE_TMA where :func:`use_tma`; either
    off where ``variants`` turns it off."""
    wanted = {"FUSED_SCALE": True, "USE_TMA": True, **(variants or {})}
    return {"FUSED_SCALE": bool(wanted["FUSED_SCALE"]) and scale > 0,
            "USE_TMA": bool(wanted["USE_TMA"]) and use_tma(q, k, v, o)}


def _launch_flash_fwd(q, k, v, o, lse, scale: float, causal: bool, config: tuple[int, int, int, int]) -> None:
    """Run _flash_fwd_kernel into o [Sq, H, D] and lse [H, Sq]; config = (BLOCK_M, BLOCK_N, num_warps,
    num_stages)."""
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    block_m, block_n, warps, stages = config
    tma = use_tma(q, k, v, o)
    if tma:
        qa, ka, va, oa = (
            TensorDescriptor(t, [t.shape[0], t.shape[1] * D], [t.stride(0), 1], [rows, D])
            for t, rows in ((q, block_m), (k, block_n), (v, block_n), (o, block_m)))
    else:
        qa, ka, va, oa = q, k, v, o
    _flash_fwd_kernel[(cdiv(Sq, block_m), H)](
        qa, ka, va, oa, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        Sq, Sk, scale * LOG2E,
        GROUP=H // KVH, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=causal,
        FUSED_SCALE=scale > 0, USE_TMA=tma, num_warps=warps, num_stages=stages,
    )


def dense_tile_config(q: torch.Tensor) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the dense kernel for q's dtype, head dim (a supported one) and
    GPU; small tiles under the interpreter."""
    if INTERPRET:
        return INTERPRET_CONFIG
    D = q.shape[2]
    configs = GPU_CONFIGS_FP32 if q.element_size() > 2 else GPU_CONFIGS
    if q.element_size() <= 2 and D in GPU_CONFIGS_SM90 and torch.cuda.get_device_capability(q.device)[0] >= 9:
        configs = GPU_CONFIGS_SM90
    return configs[D]


def masked_attention_rows(q_rows: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, mask: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference attention of q_rows [r, H, D] over kf/vf [H, S, D] (fp32, KV heads already repeated) where
    mask [H or 1, r, S] allows. -> (o [r, H, D] fp32, lse [H, r]); rows with no allowed key give o = 0, lse = -inf."""
    s = torch.matmul(q_rows.float().transpose(0, 1), kf.transpose(1, 2)) * scale  # [H, r, S]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, r]
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.matmul(p, vf).transpose(0, 1), lse


def flash_attn_with_lse_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    softmax_scale: float | None = None, causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch fp32 reference: returns o [Sq, H, D] (q.dtype), lse [H, Sq] fp32."""
    check_qkv(q, k, v)
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    group = H // KVH
    qf = q.float().transpose(0, 1)  # [H, Sq, D]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, Sk, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, Sk, D]
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, Sq, Sk]
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Sq]; -inf for rows with no visible key
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # [H, Sq, Sk]
    o = torch.matmul(p, vf)  # [H, Sq, D]
    return o.transpose(0, 1).to(q.dtype), lse.contiguous()


def _empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    Sq, H, _ = q.shape
    o = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((H, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    return o, lse


def _flash_attn_triton(q, k, v, scale: float, causal: bool, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"triton attention supports head dims {SUPPORTED_HEAD_DIMS}; got D={D} "
            f"(q {tuple(q.shape)})")
    if Sq <= DECODE_MAX_SQ:
        from .decode_attention import decode_attention_triton  # here: decode_attention imports this module

        return decode_attention_triton(q, k, v, scale, causal, pdl=pdl)
    if scale > 0 and sm90_attention_ok(q, k, v):  # Hopper: the warp-specialized Gluon kernel
        return flash_attn_sm90(q, k, v, scale, causal)
    block_m, block_n, warps, stages = dense_tile_config(q)
    o = alloc_output((Sq, H, D), q.dtype, q.device)  # [Sq, H, D]
    lse = alloc_output((H, Sq), torch.float32, q.device)  # [H, Sq]
    _launch_flash_fwd(q, k, v, o, lse, scale, causal, (block_m, block_n, warps, stages))
    return o, lse


def flash_attn_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    softmax_scale: float | None = None, causal: bool = False, *, kernels: KernelChoice | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence. q [Sq, H, D], k/v [Sk, KVH, D] -> o [Sq, H, D], lse [H, Sq].

    lse is fp32 natural-log log-sum-exp of the scaled scores (-inf for rows with no key). ``kernels`` picks the
    backend (default: the process default for q's device, sparsekv.kernels._dispatch.default_kernels).
    """
    check_qkv(q, k, v)
    Sq, H, D = q.shape
    Sk = k.shape[0]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if Sq == 0 or Sk == 0:
        return _empty_result(q)
    kernels = kernels if kernels is not None else default_kernels(q.device)
    backend = attention_backend(kernels.attention, q.dtype, causal, Sq, Sk, D)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        if backend in ("flash_attn", "sdpa", "cudnn"):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if backend == "flash_attn":
        return flash_attn_package(q, k, v, scale, causal)
    if backend in ("sdpa", "cudnn"):
        return torch_fused_attention(q, k, v, scale, causal, backend)
    if backend == "triton":
        return _flash_attn_triton(q, k, v, scale, causal, kernels.pdl)
    return flash_attn_with_lse_reference(q, k, v, scale, causal)
