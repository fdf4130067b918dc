"""Prefill/chunk attention over fp8 K/V blocks, dequantized on load (the fp8 host tier's ring groups).

flash_attn_fp8_with_lse(q [Sq, H, D], k/v [Sk, KVH, D] float8_e4m3fn, (k_scale, v_scale) [nb, KVH] float32)
    -> (o [Sq, H, D] q.dtype, lse [H, Sq] fp32), what flash_attn_with_lse returns for the dequantized keys and values
    k[j, h] * k_scale[j // bs, h] and v[j, h] * v_scale[j // bs, h], bs = Sk / nb (the block size).
Causal masking is bottom-right aligned, rows with no visible key give o = 0 and lse = -inf, as in attention.py.

The kernel walks keys in tiles of BLOCK_N that divide the block size, so a tile lies inside one block and both of
its scales are scalars: S = (q . k8) * k_scale * softmax_scale, and V's scale goes on the tile's partial,
p @ (v8 * v_scale) = (p @ v8) * v_scale, one multiply per accumulator row rather than per value. fp8 converts to
q's dtype exactly, so this equals attention over the dequantized K/V up to the order of rounding. Calls of at most
attention.DECODE_MAX_SQ query rows run the flash-decoding split kernel, which dequantizes on load too.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ._dispatch import alloc_output, cdiv, default_kernels, exact_dot, jit, tl
from .attention import (DECODE_MAX_SQ, LOG2E, SUPPORTED_HEAD_DIMS, _empty_result, causal_key_bounds,
                        dense_tile_config, flash_attn_with_lse, flash_attn_with_lse_reference)
from .fp8_kv import check_fp8_kv, dequantize_kv

if TYPE_CHECKING:
    from .backend import KernelChoice

__all__ = ["check_fp8_kv", "dequantize_kv", "flash_attn_fp8_with_lse", "flash_attn_fp8_with_lse_reference"]

Scales = tuple[torch.Tensor, torch.Tensor]  # k_scale, v_scale [nb, KVH] float32
MIN_BLOCK_N = 16  # tl.dot's smallest tile


@jit
def _fp8_block_loop(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, ks_ptr, vs_ptr, offs_m, offs_n,
    lo, hi, causal_off, stride_kn, stride_vn, stride_sb, scale_block, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):
    # acc [BLOCK_M, D] fp32; m_i, l_i [BLOCK_M] fp32 (running max in log2 units, row sum). k_ptrs/v_ptrs: [BLOCK_N, D]
    # fp8 pointer blocks at key 0; ks_ptr/vs_ptr: this kv head's scale of block 0. Every tile is whole (Sk is a
    # multiple of BLOCK_N) and inside one block; MASKED applies the causal mask.
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        blk = (start_n // scale_block) * stride_sb
        k_scale = tl.load(ks_ptr + blk)
        v_scale = tl.load(vs_ptr + blk)
        k = tl.load(k_ptrs).to(q.dtype)  # [BLOCK_N, D]; exact: every e4m3 value fits q's dtype
        v = tl.load(v_ptrs).to(q.dtype)
        s = exact_dot(q, tl.trans(k), None) * (k_scale * qk_scale)  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            cols = start_n + offs_n  # [BLOCK_N]
            s = tl.where(cols[None, :] <= offs_m[:, None] + causal_off, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if MASKED:  # rows that have seen no key yet keep m = -inf and shift by 0, so exp2 gives 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + exact_dot(p.to(q.dtype), v, None) * v_scale
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, m_i, l_i


@jit
def _flash_fwd_fp8_kernel(
    Q, K, V, KS, VS, O, LSE,
    stride_qm, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_sb,
    stride_om, stride_oh, stride_od,
    stride_lh, stride_lm,
    Sq, Sk, qk_scale, scale_block,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]

    q = tl.load(Q + head.to(tl.int64) * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm
                + offs_d[None, :] * stride_qd, mask=offs_m[:, None] < Sq, other=0.0)  # [BLOCK_M, D]
    k_ptrs = K + kv_head.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + kv_head.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    causal_off, full_hi, hi = causal_key_bounds(start_m, Sq, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = _fp8_block_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, KS + kv_head, VS + kv_head, offs_m, offs_n, 0, full_hi, causal_off,
        stride_kn, stride_vn, stride_sb, scale_block, qk_scale, BLOCK_N, False)
    if IS_CAUSAL:
        acc, m_i, l_i = _fp8_block_loop(
            acc, m_i, l_i, q, k_ptrs, v_ptrs, KS + kv_head, VS + kv_head, offs_m, offs_n, full_hi, hi, causal_off,
            stride_kn, stride_vn, stride_sb, scale_block, qk_scale, BLOCK_N, True)

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row_ok = offs_m < Sq
    tl.store(O + head.to(tl.int64) * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + head.to(tl.int64) * stride_lh + offs_m * stride_lm, lse, mask=row_ok)


def flash_attn_fp8_with_lse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: Scales,
                                      softmax_scale: float | None = None,
                                      causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch: dequantize k/v to q's dtype, then flash_attn_with_lse_reference."""
    check_fp8_kv(q, k, v, scales)
    kd, vd = (dequantize_kv(x, s, q.dtype) for x, s in zip((k, v), scales))
    return flash_attn_with_lse_reference(q, kd, vd, softmax_scale, causal)


def fp8_block_n(block_n: int, block_size: int) -> int:
    """The key tile of a call: the configured BLOCK_N, or the largest power of two dividing the block size below
    it, so that a tile never straddles two blocks' scales."""
    tile = math.gcd(block_n, block_size)
    if tile < MIN_BLOCK_N:
        raise ValueError(f"fp8 attention: the block size {block_size} must be a multiple of {MIN_BLOCK_N} (the "
                         f"smallest key tile, which must lie inside one block); use offload.block_size a multiple "
                         f"of {MIN_BLOCK_N}")
    return tile


def _launch_fp8(q, k, v, scales: Scales, o, lse, scale: float, causal: bool,
                config: tuple[int, int, int, int], block_size: int) -> None:
    """Run _flash_fwd_fp8_kernel into o [Sq, H, D] and lse [H, Sq]; config = (BLOCK_M, BLOCK_N, num_warps,
    num_stages), BLOCK_N shrunk to divide block_size."""
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    block_m, block_n, warps, stages = config
    block_n = fp8_block_n(block_n, block_size)
    k_scale, v_scale = scales
    _flash_fwd_fp8_kernel[(cdiv(Sq, block_m), H)](
        q, k, v, k_scale, v_scale, o, lse,
        *q.stride(), *k.stride(), *v.stride(), k_scale.stride(0), *o.stride(), *lse.stride(),
        Sq, Sk, scale * LOG2E, block_size,
        GROUP=H // KVH, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=bool(causal),
        num_warps=warps, num_stages=stages)


def flash_attn_fp8_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: Scales,
                            softmax_scale: float | None = None, causal: bool = False, *,
                            kernels: KernelChoice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_lse of q [Sq, H, D] over fp8 k/v [Sk, KVH, D] with their per-(block, KV head) scales
    (k_scale, v_scale [nb, KVH] float32; block size Sk / nb, a multiple of 16 on the Triton path). The Triton kernels
    dequantize on load where ``kernels`` says Triton (default: the process default for q's device); otherwise the
    keys and values are dequantized in torch and attended by flash_attn_with_lse."""
    block_size = check_fp8_kv(q, k, v, scales)
    Sq, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if Sq == 0 or k.shape[0] == 0:
        return _empty_result(q)
    kernels = kernels if kernels is not None else default_kernels(q.device)
    if not kernels.triton or D not in SUPPORTED_HEAD_DIMS or k.stride(2) != 1 or v.stride(2) != 1:
        kd, vd = (dequantize_kv(x, s, q.dtype) for x, s in zip((k, v), scales))
        return flash_attn_with_lse(q, kd, vd, scale, causal, kernels=kernels)
    if Sq <= DECODE_MAX_SQ:
        from .decode_attention import DecodePartials  # here: decode_attention imports attention, as this does

        partials = DecodePartials(q, scale, max_sets=1, kernels=kernels)
        partials.add(k, v, causal=causal, scales=scales)
        return partials.finish()
    o = alloc_output((Sq, H, D), q.dtype, q.device)  # [Sq, H, D]
    lse = alloc_output((H, Sq), torch.float32, q.device)  # [H, Sq]
    _launch_fp8(q, k, v, scales, o, lse, scale, causal, dense_tile_config(q), block_size)
    return o, lse
