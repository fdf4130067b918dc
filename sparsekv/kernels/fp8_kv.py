"""fp8 (e4m3fn) KV blocks with one float32 scale per (block, KV head).

A block [n, KVH, D] is stored as fp8 values x / scale[h] and scale[h] = amax(|x[:, h, :]|) / 448 (448: the largest
finite e4m3fn value), so each head of each block uses the whole fp8 range; an all-zero head gets scale 0 and
dequantizes to 0. Dequantization is x8.float() * scale: exact in float32 and, for fp8 inputs, in bfloat16/float16
too before the multiply.

quantize_block(x [n, KVH, D], out [>= n, KVH, D] fp8, scale_out [KVH] fp32)       at offload (torch ops, on the
    device that holds x: a few launches per block, off the decode path's steps)
dequantize_blocks(x8 [nb, bs, KVH, D] fp8, scales [nb, KVH] fp32, out [nb, bs, KVH, D]) a ring group for a reader
    that wants model-dtype K/V: one Triton launch (reference: dequantize_blocks_reference)
The decode split kernel (decode_attention.DecodePartials.add(..., scales=)) dequantizes ring slots on load instead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._dispatch import INTERPRET, cdiv, default_kernels, jit, tl

if TYPE_CHECKING:
    from .backend import KernelChoice

__all__ = ["FP8_DTYPE", "FP8_MAX", "dequantize_blocks", "dequantize_blocks_reference", "quantize_block"]

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
