"""Fused (optional per-head RMSNorm) + rotary position embedding for q [N, H, D] and k [N, KVH, D].

Semantics (the torch references below, which the model's torch path runs; HF's rotate-half layout):

    cos, sin = cos/sin(cat(f, f)) * attention_scaling, cast to the activation dtype,  f = positions.float() * inv_freq
    x        = rms_norm(x, norm_weight)                 (Qwen3's q_norm / k_norm; skipped without a weight)
    out      = x * cos + rotate_half(x) * sin           each product and the sum rounded to x's dtype

The kernel computes cos/sin in-kernel from the positions (fp32, like the reference), so no [N, D] tables are
built per step. One launch covers q and k: program (t, b) handles a block of BLOCK_T tokens and a block of heads,
the first blocks of q, then those of k. Decode-sized calls (N < PREFILL_MIN_TOKENS) run one token and BLOCK_H
heads per program; long prefills run PREFILL_TILE: BLOCK_T tokens and up to all q heads per program, so that each
program keeps more loads in flight and computes each token's cos/sin once for more heads. Both tilings give the
same bits. Outputs are new contiguous tensors of fixed shapes; no host syncs: safe inside CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._dispatch import (
    alloc_output,
    cdiv,
    jit,
    next_power_of_2,
    pdl_launch_options,
    pdl_wait,
    tl,
)
from .rmsnorm import KERNEL_DTYPES, rms_norm_reference

__all__ = ["KVWrite", "apply_rotary", "apply_rotary_reference", "rotary_cos_sin_reference", "rotary_embed_reference",
           "rotate_half"]

MAX_TILE = 1024  # elements of one [BLOCK_H, BLOCK_HALF] half-tile
NUM_WARPS = 4
# The prefill tiling (BLOCK_T tokens, q heads per program, warps) and the token count from which it runs: chosen by
# `python tools/bench_kernels.py --rotary-sweep` and `--elementwise` on the GPU (docs/decisions.md).
PREFILL_TILE = (1, 32, 2)
PREFILL_MIN_TOKENS = 8192
PREFILL_MAX_PER_THREAD = 32  # elements of a [BLOCK_T, heads, BLOCK_HALF] half-tile per thread: see _tiling


# ---------------------------------------------------------------------------------------------- references
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_cos_sin_reference(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N], inv_freq [D/2] -> cos, sin [N, D] in `dtype` (fp32 math, scaled, then cast)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def rotary_embed_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D], cos/sin [N, D] -> x * cos + rotate_half(x) * sin."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                           attention_scaling: float, q_norm_weight: torch.Tensor | None = None,
                           k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch: per-head RMSNorm (where a weight is given), then rotary, with cos/sin in q's dtype."""
    cos, sin = rotary_cos_sin_reference(positions, inv_freq, attention_scaling, q.dtype)
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rms_norm_reference(k, k_norm_weight, eps)
    return rotary_embed_reference(q, cos, sin), rotary_embed_reference(k, cos, sin)


# ---------------------------------------------------------------------------------------------- kernel
# 2*pi split in three float32 parts for Cody-Waite reduction: 6.28125 + 1.935307e-3 + 1.025313e-11
TWO_PI_HI = tl.constexpr(6.28125)
TWO_PI_MID = tl.constexpr(0.0019353071693331003)
TWO_PI_LO = tl.constexpr(1.0253131677018246e-11)
INV_TWO_PI = tl.constexpr(0.15915494309189535)


@jit
def _reduce_angle(x):
    """x - k * 2*pi with k = round(x / 2*pi), in [-pi, pi]: tl.cos/tl.sin lower to the GPU's approximate
    sin/cos, accurate near 0 but off by ~1e-5 at a few hundred radians (and worse at long-context positions),
    where torch's cos/sin are exact to an ulp. Three fused multiply-adds keep the reduction exact enough."""
    k = tl.floor(x * INV_TWO_PI + 0.5)
    r = tl.fma(-k, TWO_PI_HI, x)
    r = tl.fma(-k, TWO_PI_MID, r)
    return tl.fma(-k, TWO_PI_LO, r)


@jit
def _norm_rope_tile(
    X, OUT, W, rows, row_ok, head0, num_heads, stride_xn, stride_xh, stride_on, stride_oh,
    cos, sin, offs_d, d_ok, eps, D, HALF, CACHE, cache_rows, stride_ch,
    HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, WRITE_CACHE: tl.constexpr,
):
    """Heads head0 .. head0 + BLOCK_H of the tokens `rows` [BLOCK_T]: x [BLOCK_T, BLOCK_H, D] as halves x1, x2
    [BLOCK_T, BLOCK_H, BLOCK_HALF], cos/sin [BLOCK_T, 1, BLOCK_HALF]. WRITE_CACHE: the result also goes to CACHE
    at cache_rows (pointers to the tokens' slots, [BLOCK_T]) [heads, D]."""
    act = X.dtype.element_ty
    odt = OUT.dtype.element_ty
    offs_h = head0 + tl.arange(0, BLOCK_H)
    ok = row_ok[:, None, None] & (offs_h < num_heads)[None, :, None] & d_ok[None, None, :]
    x_ptr = X + rows[:, None, None] * stride_xn + offs_h[None, :, None] * stride_xh + offs_d[None, None, :]
    x1 = tl.load(x_ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / D + eps)[:, :, None]
        w1 = tl.load(W + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :]
        w2 = tl.load(W + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :]
        # normalise in fp32, round to the activation dtype, scale in the output dtype
        x1 = (w1 * (x1 * inv).to(act).to(tl.float32)).to(odt).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(act).to(tl.float32)).to(odt).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product and the sum rounded like torch's
    o1 = ((x1 * cos).to(odt).to(tl.float32) + (-x2 * sin).to(odt).to(tl.float32)).to(odt)
    o2 = ((x2 * cos).to(odt).to(tl.float32) + (x1 * sin).to(odt).to(tl.float32)).to(odt)
    o_ptr = OUT + rows[:, None, None] * stride_on + offs_h[None, :, None] * stride_oh + offs_d[None, None, :]
    tl.store(o_ptr, o1, mask=ok)
    tl.store(o_ptr + HALF, o2, mask=ok)
    if WRITE_CACHE:
        c_ptr = cache_rows[:, None, None] + offs_h[None, :, None] * stride_ch + offs_d[None, None, :]
        tl.store(c_ptr, o1.to(CACHE.dtype.element_ty), mask=ok)
        tl.store(c_ptr + HALF, o2.to(CACHE.dtype.element_ty), mask=ok)


@jit(do_not_specialize=["N"])
def _rotary_kernel(
    Q, K, QO, KO, QW, KW, POS, INV_FREQ, V, K_CACHE, V_CACHE, SLOTS,
    stride_qn, stride_qh, stride_kn, stride_kh,
    stride_qon, stride_qoh, stride_kon, stride_koh, stride_pos,
    stride_vn, stride_vh, stride_cs, stride_ch, stride_slot,
    N, H, KVH, Q_BLOCKS, scaling, eps, D, HALF,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, WRITE_KV: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    VEC: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (i, blk): tokens i * BLOCK_T .. + BLOCK_T; q heads blk * BLOCK_H .. + BLOCK_H while blk < Q_BLOCKS,
    else k (and v) heads (blk - Q_BLOCKS) * BLOCK_KH .. + BLOCK_KH."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    blk = tl.program_id(1)
    act = Q.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_HALF)
    if VEC < BLOCK_HALF:
        # caps the vector width along D at the decode tile's (through the alignment, so that D stays the fastest
        # dim): the same per-thread split of each head's sum of squares, so the RMSNorm adds in the same order
        offs_d = tl.multiple_of(offs_d, VEC)
    d_ok = offs_d < HALF
    # positions (and slots) are copied in before the step's first kernel, inv_freq is constant: cos/sin are
    # computed before the wait, under the previous kernel's tail
    pos = tl.load(POS + rows * stride_pos, mask=row_ok, other=0).to(tl.float32)
    freqs = pos[:, None] * tl.load(INV_FREQ + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    freqs = _reduce_angle(freqs)  # [BLOCK_T, BLOCK_HALF]
    # cast to the activation dtype like the reference; [BLOCK_T, 1, BLOCK_HALF], shared by the program's heads
    cos = (tl.cos(freqs) * scaling).to(act).to(tl.float32)[:, None, :]
    sin = (tl.sin(freqs) * scaling).to(act).to(tl.float32)[:, None, :]
    pdl_wait(USE_PDL)
    if blk < Q_BLOCKS:
        _norm_rope_tile(Q, QO, QW, rows, row_ok, blk * BLOCK_H, H, stride_qn, stride_qh, stride_qon, stride_qoh,
                        cos, sin, offs_d, d_ok, eps, D, HALF, QO, rows, 0,
                        HAS_NORM=HAS_Q_NORM, BLOCK_H=BLOCK_H, WRITE_CACHE=False)
    else:
        head0 = (blk - Q_BLOCKS) * BLOCK_KH
        if WRITE_KV:  # k (normed, rotated) and v as is into their cache slots: [slots, KVH, D] each
            slots = tl.load(SLOTS + rows * stride_slot, mask=row_ok, other=0).to(tl.int64)
            _norm_rope_tile(K, KO, KW, rows, row_ok, head0, KVH, stride_kn, stride_kh, stride_kon, stride_koh,
                            cos, sin, offs_d, d_ok, eps, D, HALF, K_CACHE, K_CACHE + slots * stride_cs, stride_ch,
                            HAS_NORM=HAS_K_NORM, BLOCK_H=BLOCK_KH, WRITE_CACHE=True)
            offs_h = head0 + tl.arange(0, BLOCK_KH)
            ok = row_ok[:, None, None] & (offs_h < KVH)[None, :, None] & d_ok[None, None, :]
            v_ptr = V + rows[:, None, None] * stride_vn + offs_h[None, :, None] * stride_vh + offs_d[None, None, :]
            c_ptr = (V_CACHE + slots[:, None, None] * stride_cs + offs_h[None, :, None] * stride_ch
                     + offs_d[None, None, :])
            tl.store(c_ptr, tl.load(v_ptr, mask=ok, other=0.0), mask=ok)
            tl.store(c_ptr + HALF, tl.load(v_ptr + HALF, mask=ok, other=0.0), mask=ok)
        else:
            _norm_rope_tile(K, KO, KW, rows, row_ok, head0, KVH, stride_kn, stride_kh, stride_kon, stride_koh,
                            cos, sin, offs_d, d_ok, eps, D, HALF, KO, rows, 0,
                            HAS_NORM=HAS_K_NORM, BLOCK_H=BLOCK_KH, WRITE_CACHE=False)


# ---------------------------------------------------------------------------------------------- launcher
def _check(q, k, positions, inv_freq, q_norm_weight, k_norm_weight) -> None:
    shapes = (f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}, "
              f"inv_freq {tuple(inv_freq.shape)}")
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"apply_rotary expects q [N, H, D] and k [N, KVH, D]; got {shapes}")
    n, _, d = q.shape
    if d % 2:
        raise ValueError(f"apply_rotary needs an even head dim D; got {shapes}")
    if tuple(positions.shape) != (n,) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"apply_rotary expects integer positions [N] = [{n}]; got {shapes}, {positions.dtype}")
    if tuple(inv_freq.shape) != (d // 2,):
        raise ValueError(f"apply_rotary expects inv_freq [D/2] = [{d // 2}]; got {shapes}")
    if q.dtype != k.dtype or not q.dtype.is_floating_point:
        raise ValueError(f"apply_rotary expects q and k of one float dtype; got q {q.dtype}, k {k.dtype} ({shapes})")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (tuple(w.shape) != (d,) or not w.dtype.is_floating_point):
            raise ValueError(f"apply_rotary expects a float {name} [D] = [{d}]; got {tuple(w.shape)} {w.dtype} "
                             f"({shapes})")
    devices = {t.device for t in (q, k, positions, inv_freq, q_norm_weight, k_norm_weight) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"apply_rotary: tensors on several devices {sorted(map(str, devices))} ({shapes})")


class KVWrite(NamedTuple):
    """Where :func:`apply_rotary` also stores this step's keys (after norm and rotary) and values, as
    sparsekv.kernels.paged_attention.store_kv would: cache[slot_mapping[i]] = k[i] / v[i]."""
    v: torch.Tensor  # [N, KVH, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D] (any leading dims that flatten to slots)
    v_cache: torch.Tensor  # like k_cache
    slot_mapping: torch.Tensor  # [N] integer: block * block_size + offset


def _check_kv_write(k_dtype: torch.dtype, k: torch.Tensor, kv: KVWrite) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as [slots, KVH, D] views; errors name the mismatch."""
    n, kvh, d = k.shape
    v, k_cache, v_cache, slots = kv
    shapes = (f"k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
              f"{tuple(v_cache.shape)}, slot_mapping {tuple(slots.shape)}")
    if v.shape != k.shape or k_cache.shape != v_cache.shape or tuple(k_cache.shape[-2:]) != (kvh, d):
        raise ValueError(f"apply_rotary's kv write expects v like k and caches [..., KVH, D]; got {shapes}")
    if tuple(slots.shape) != (n,) or slots.dtype.is_floating_point or slots.dtype == torch.bool:
        raise ValueError(f"apply_rotary's kv write expects integer slot_mapping [N] = [{n}]; got {shapes}")
    if not (k_dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"apply_rotary's kv write: the rotated k ({k_dtype}), v ({v.dtype}) and the caches "
                         f"({k_cache.dtype}, {v_cache.dtype}) must share a dtype ({shapes})")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"apply_rotary's kv write expects caches of one layout, unit stride along D; got strides "
                         f"{k_cache.stride()} and {v_cache.stride()} ({shapes})")
    return k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)  # [slots, KVH, D]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 attention_scaling: float, q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, kv_write: KVWrite | None = None, *,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, D], k [N, KVH, D] (any strides; the model's are views of the fused qkv projection), positions [N]
    (any integer dtype and stride), inv_freq [D/2] -> new contiguous (q, k) after the optional per-head RMSNorm
    and rotary; with ``kv_write`` the new k and the given v are also stored into the KV cache slots (one launch
    instead of this kernel and two index copies). The Triton kernel (``pdl``: launched with programmatic dependent
    launch); :func:`apply_rotary_reference` is its torch reference."""
    _check(q, k, positions, inv_freq, q_norm_weight, k_norm_weight)
    if q.dtype not in KERNEL_DTYPES or any(w is not None and w.dtype not in KERNEL_DTYPES
                                           for w in (q_norm_weight, k_norm_weight)):
        raise ValueError(f"the Triton apply_rotary supports {KERNEL_DTYPES}; got q {tuple(q.shape)} {q.dtype}")
    n, h, d = q.shape
    kvh = k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_dtype = q.dtype if q_norm_weight is None else torch.promote_types(q.dtype, q_norm_weight.dtype)
    k_dtype = k.dtype if k_norm_weight is None else torch.promote_types(k.dtype, k_norm_weight.dtype)
    if kv_write is not None:
        k_flat, v_flat = _check_kv_write(k_dtype, k, kv_write)
        v, slots = kv_write.v, kv_write.slot_mapping
        v = v if v.stride(-1) == 1 else v.contiguous()
    else:
        k_flat = v_flat = v = slots = k  # unused
    q_out = alloc_output((n, h, d), q_dtype, q.device)
    k_out = alloc_output((n, kvh, d), k_dtype, k.device)
    if n == 0 or d == 0 or h + kvh == 0:
        return q_out, k_out
    half = d // 2
    block_half = next_power_of_2(half)
    block_h = max(1, min(_heads_per_program(h, kvh), MAX_TILE // block_half))
    block_t, block_hq, num_warps, vec = _tiling(n, h, block_h, block_half)
    q_blocks = cdiv(h, block_hq)
    grid = (cdiv(n, block_t), q_blocks + cdiv(kvh, block_h))
    _rotary_kernel[grid](
        q, k, q_out, k_out,
        q_norm_weight if q_norm_weight is not None else q, k_norm_weight if k_norm_weight is not None else k,
        positions, inv_freq, v, k_flat, v_flat, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), positions.stride(0),
        v.stride(0), v.stride(1), k_flat.stride(0), k_flat.stride(1), slots.stride(0),
        n, h, kvh, q_blocks, float(attention_scaling), float(eps), d, half,
        HAS_Q_NORM=q_norm_weight is not None, HAS_K_NORM=k_norm_weight is not None, WRITE_KV=kv_write is not None,
        BLOCK_T=block_t, BLOCK_H=block_hq, BLOCK_KH=block_h, BLOCK_HALF=block_half, VEC=vec, num_warps=num_warps,
        # no FMA contraction: every product and sum rounds as written, like torch's, whatever code shape a tile
        # compiles to (the compiler contracts by code distance, so tiles would otherwise round differently)
        enable_fp_fusion=False, **pdl_launch_options(pdl),
    )
    return q_out, k_out


def _heads_per_program(h: int, kvh: int) -> int:
    """The KV head count rounded up to a power of two: k takes one block, q whole blocks of a GQA group."""
    return next_power_of_2(kvh if kvh > 0 else h)


def _tiling(n: int, h: int, block_h: int, block_half: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, q heads per program, num_warps, VEC) for N tokens; block_h heads per program is the decode tile
    (and k's in both tilings). The prefill tile keeps the decode tile's vector width along D (VEC), warps along D
    and at least its elements per thread (num_warps <= NUM_WARPS * BLOCK_T), which fix how each head's sum of
    squares is split over the threads, so that its RMSNorm adds in the same order. It also keeps at most
    PREFILL_MAX_PER_THREAD elements of a half-tile per thread (fewer q heads, then fewer tokens): larger tiles
    spill registers."""
    if n < PREFILL_MIN_TOKENS:
        return 1, block_h, NUM_WARPS, block_half
    block_t, q_heads, num_warps = PREFILL_TILE
    block_t = next_power_of_2(block_t)
    num_warps = min(num_warps, NUM_WARPS * block_t, 32)  # 32: a CUDA block's most warps
    # the decode tile spreads a head's half over up to NUM_WARPS warps (32 lanes each, one element a lane at the
    # least): as many here
    num_warps = NUM_WARPS if block_half > 32 * NUM_WARPS else max(num_warps, min(NUM_WARPS, block_half // 32))
    block_hq = max(block_h, min(next_power_of_2(q_heads), next_power_of_2(h)))
    while block_t * block_hq * block_half > PREFILL_MAX_PER_THREAD * 32 * num_warps:
        if block_hq > block_h:
            block_hq //= 2
        elif block_t > 1:
            block_t //= 2
            num_warps = min(num_warps, NUM_WARPS * block_t)
        else:
            break
    vec = min(block_half, max(1, block_h * block_half // (32 * NUM_WARPS)))
    return block_t, block_hq, num_warps, vec
