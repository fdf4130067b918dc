"""fp8 (e4m3fn) KV blocks with one float32 scale per (block, KV head).

A block [n, KVH, D] is stored as fp8 values x / scale[h] and scale[h] = amax(|x[:, h, :]|) / 448 (448: the largest
finite e4m3fn value), so each head of each block uses the whole fp8 range; an all-zero head gets scale 0 and
dequantizes to 0. Dequantization is x8.float() * scale: exact in float32 and, for fp8 inputs, in bfloat16/float16
too before the multiply.

quantize_block(x [n, KVH, D], out [>= n, KVH, D] fp8, scale_out [KVH] fp32)       the reference quantization
quantize_kv_block(k, v [n, KVH, D], out [2, n, KVH, D] fp8, scales [2, KVH] fp32)   at offload: K and V of one block
    in one Triton launch (reference: quantize_block on each)
dequantize_blocks(x8 [nb, bs, KVH, D] fp8, scales [nb, KVH] fp32, out [nb, bs, KVH, D]) a ring group for a reader
    that computes on model-dtype K/V itself (MInference's prefill): one Triton launch (reference:
    dequantize_blocks_reference)
The prefill kernel (fp8_attention.flash_attn_fp8_with_lse) and the decode split kernel
(decode_attention.DecodePartials.add(..., scales=)) dequantize ring slots on load instead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._dispatch import INTERPRET, cdiv, default_kernels, jit, tl

if TYPE_CHECKING:
    from .backend import KernelChoice

__all__ = ["FP8_DTYPE", "FP8_MAX", "dequantize_blocks", "dequantize_blocks_reference", "quantize_block",
           "quantize_kv_block"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
CHUNK = 2048  # elements of one (block, head) row range per program


def quantize_block(x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """x [n, KVH, D] (any float dtype) -> out[:n] fp8 and scale_out [KVH] float32 (per-head amax / 448)."""
    n = x.shape[0]
    if x.dim() != 3 or out.dim() != 3 or out.shape[1:] != x.shape[1:] or out.shape[0] < n:
        raise ValueError(f"quantize_block: expected x [n, KVH, D] and out [>= n, KVH, D]; got {tuple(x.shape)} and "
                         f"{tuple(out.shape)}")
    if out.dtype != FP8_DTYPE or scale_out.dtype != torch.float32 or scale_out.shape != (x.shape[1],):
        raise ValueError(f"quantize_block: expected out {FP8_DTYPE} and scale_out [{x.shape[1]}] float32; got "
                         f"{out.dtype} and {tuple(scale_out.shape)} {scale_out.dtype}")
    xf = x.float()
    amax = xf.abs().amax(dim=(0, 2))  # [KVH]
    scale_out.copy_(amax / FP8_MAX)
    inv = torch.where(amax > 0, FP8_MAX / amax, torch.zeros_like(amax))  # [KVH]; 0 keeps zero heads at 0
    out[:n].copy_((xf * inv[None, :, None]).clamp_(-FP8_MAX, FP8_MAX))


@jit
def round_to_e4m3(y):
    """fp32 y (|y| <= 448) rounded to e4m3fn's grid (3 mantissa bits; below 2^-6 the subnormal step 2^-9), ties to
    even as torch's cast rounds, so that the cast to fp8 is exact everywhere: Triton's interpreter mis-rounds values
    that carry into the next binade (-127.2 -> -64)."""
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(y), 0.015625))) - 3.0)
    steps = tl.abs(y) / step  # exact: step is a power of two
    rounded = tl.floor(steps + 0.5)
    rounded = tl.where((rounded - steps == 0.5) & (rounded % 2.0 == 1.0), rounded - 1.0, rounded)
    return tl.where(y < 0, -1.0, 1.0) * rounded * step


@jit
def _quantize_kernel(K, V, O, S, n, stride_kn, stride_kh, stride_vn, stride_vh, stride_ok, stride_on, stride_oh,
                     kvh, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    kv = tl.program_id(0)  # 0: K, 1: V
    head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    dims = tl.arange(0, HEAD_DIM)  # [D]
    if kv == 0:
        src, stride_n = K + head * stride_kh, stride_kn
    else:
        src, stride_n = V + head * stride_vh, stride_vn
    amax = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for r0 in range(0, n, BLOCK_ROWS):
        ok = (r0 + rows) < n
        x = tl.load(src + (r0 + rows)[:, None].to(tl.int64) * stride_n + dims[None, :], mask=ok[:, None], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 0))
    top = tl.max(amax, 0)
    tl.store(S + kv * kvh + head, top / 448.0)
    inv = tl.where(top > 0, 448.0 / tl.maximum(top, 1e-30), 0.0)  # 0 keeps an all-zero head at 0
    dst = O + kv * stride_ok + head * stride_oh
    for r0 in range(0, n, BLOCK_ROWS):
        ok = (r0 + rows) < n
        offs = (r0 + rows)[:, None].to(tl.int64)
        x = tl.load(src + offs * stride_n + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        y = round_to_e4m3(tl.minimum(tl.maximum(x * inv, -448.0), 448.0))
        tl.store(dst + offs * stride_on + dims[None, :], y.to(O.dtype.element_ty), mask=ok[:, None])


def quantize_kv_block(k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, *,
                      kernels: KernelChoice | None = None) -> None:
    """K and V of one block, k/v [n, KVH, D] (any float dtype, unit last stride) -> out [2, n, KVH, D] fp8
    (contiguous) and scales [2, KVH] float32 (contiguous): quantize_block of each, in one launch where ``kernels``
    says Triton (default: the process default)."""
    n, kvh, d = k.shape if k.dim() == 3 else (0, 0, 0)
    if k.dim() != 3 or v.shape != k.shape or out.shape != (2, n, kvh, d) or scales.shape != (2, kvh):
        raise ValueError(f"quantize_kv_block: expected k/v [n, KVH, D], out [2, n, KVH, D], scales [2, KVH]; got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(out.shape)}, {tuple(scales.shape)}")
    if out.dtype != FP8_DTYPE or scales.dtype != torch.float32 or not out.is_contiguous() \
            or not scales.is_contiguous():
        raise ValueError(f"quantize_kv_block: expected out {FP8_DTYPE} and scales float32, both contiguous; got "
                         f"{out.dtype} and {scales.dtype}")
    triton = (kernels if kernels is not None else default_kernels(k.device)).triton
    if not triton or d & (d - 1) or k.stride(2) != 1 or v.stride(2) != 1 or n == 0:
        quantize_block(k, out[0], scales[0])
        quantize_block(v, out[1], scales[1])
        return
    _quantize_kernel[(2, kvh)](k, v, out, scales, n, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               out.stride(0), out.stride(1), out.stride(2), kvh, HEAD_DIM=d,
                               BLOCK_ROWS=16 if INTERPRET else max(1, 4096 // d), num_warps=4)


def dequantize_blocks_reference(x8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x8.float() * scales[:, None, :, None])


@jit
def _dequantize_kernel(X, S, O, row_elems, kvh_d, head_dim, bs_stride_x, bs_stride_o, CHUNK: tl.constexpr):
    blk = tl.program_id(0)  # which block
    chunk = tl.program_id(1)  # which CHUNK elements of it
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] flat index into [bs, KVH, D]
    ok = offs < row_elems
    head = (offs % kvh_d) // head_dim
    scale = tl.load(S + blk * (kvh_d // head_dim) + head, mask=ok, other=0.0)
    x = tl.load(X + blk.to(tl.int64) * bs_stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(O + blk.to(tl.int64) * bs_stride_o + offs, (x * scale).to(O.dtype.element_ty), mask=ok)


def dequantize_blocks(x8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *,
                      kernels: KernelChoice | None = None) -> None:
    """x8 [nb, bs, KVH, D] fp8 (each block contiguous), scales [nb, KVH] float32 contiguous -> out [nb, bs, KVH, D]
    (contiguous, a float dtype). Triton where ``kernels`` says so (default: the process default), else the
    reference."""
    if x8.dim() != 4 or x8.dtype != FP8_DTYPE or out.shape != x8.shape or not out.dtype.is_floating_point:
        raise ValueError(f"dequantize_blocks: expected x8 [nb, bs, KVH, D] {FP8_DTYPE} and out of its shape; got "
                         f"{tuple(x8.shape)} {x8.dtype} and {tuple(out.shape)} {out.dtype}")
    if scales.shape != (x8.shape[0], x8.shape[2]) or scales.dtype != torch.float32 or not scales.is_contiguous():
        raise ValueError(f"dequantize_blocks: expected scales [{x8.shape[0]}, {x8.shape[2]}] float32 contiguous; "
                         f"got {tuple(scales.shape)} {scales.dtype}")
    if not x8[0:1].is_contiguous() or not out.is_contiguous():
        raise ValueError("dequantize_blocks: each block of x8, and out, must be contiguous")
    nb, bs, kvh, d = x8.shape
    if nb == 0:
        return
    triton = (kernels if kernels is not None else default_kernels(x8.device)).triton
    if not triton:
        dequantize_blocks_reference(x8, scales, out)
        return
    chunk = 256 if INTERPRET else CHUNK
    row = bs * kvh * d
    _dequantize_kernel[(nb, cdiv(row, chunk))](x8, scales, out, row, kvh * d, d, x8.stride(0), out.stride(0),
                                               CHUNK=chunk, num_warps=4)


def check_fp8_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scales: tuple[torch.Tensor, torch.Tensor], caller: str = "fp8 attention") -> int:
    """Shape, dtype and device checks of an fp8 attention call: q [Sq, H, D] (a float dtype of >= 16 bits), k/v
    [Sk, KVH, D] float8_e4m3fn, scales (k_scale, v_scale) [nb, KVH] float32 with the same strides and nb dividing
    Sk. Returns the block size Sk / nb."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2] or k.shape[1] == 0 \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"{caller}: expected q [Sq, H, D], k/v [Sk, KVH, D] with H a multiple of KVH; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return k.shape[0] // check_fp8_scales(q, k, v, scales, caller, seq_len=k.shape[0])


def check_fp8_scales(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor],
                     caller: str, *, num_blocks: int | None = None, seq_len: int | None = None,
                     kv_names: str = "k/v") -> int:
    """fp8 K/V of any layout whose second-to-last dim is KVH, read by q of a float dtype of >= 16 bits, with scales
    (k_scale, v_scale) [nb, KVH] float32 of the same strides and unit last stride, on q's device: nb = num_blocks
    (paged pages), or nb dividing seq_len (blocks of a flat [Sk, KVH, D]). Returns nb."""
    k_scale, v_scale = scales
    if k.dtype != FP8_DTYPE or v.dtype != FP8_DTYPE or not q.dtype.is_floating_point or q.element_size() < 2:
        raise ValueError(f"{caller}: expected {kv_names} {FP8_DTYPE} and q of a float dtype of 16 bits or more; "
                         f"got q {q.dtype}, {kv_names} {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == k_scale.device == v_scale.device):
        raise ValueError(f"{caller}: q, k, v and scales on different devices: {q.device}, {k.device}, "
                         f"{v.device}, {k_scale.device}, {v_scale.device}")
    nb = k_scale.shape[0] if k_scale.dim() == 2 else 0
    rows = num_blocks if num_blocks is not None else "nb"
    if (k_scale.shape != (nb, k.shape[-2]) or v_scale.shape != k_scale.shape or v_scale.stride() != k_scale.stride()
            or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32 or k_scale.stride(1) != 1 or nb == 0
            or (num_blocks is not None and nb != num_blocks) or (seq_len is not None and seq_len % nb)):
        divides = f" with nb dividing Sk={seq_len}" if seq_len is not None else ""
        raise ValueError(f"{caller}: expected k_scale/v_scale [{rows}, {k.shape[-2]}] float32 (same strides, unit "
                         f"last stride){divides}; got {tuple(k_scale.shape)} {k_scale.dtype} and "
                         f"{tuple(v_scale.shape)} {v_scale.dtype}")
    return nb


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 x [nb * bs, KVH, D] with scale [nb, KVH] -> x * scale per block and head, in `dtype` (torch)."""
    nb = scale.shape[0]
    return (x.float().unflatten(0, (nb, -1)) * scale[:, None, :, None]).flatten(0, 1).to(dtype)
