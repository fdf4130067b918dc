"""fp8 (e4m3fn) copies of q and k for XAttention's estimate, one float32 scale per (strided row, head).

quantize_strided(x [m, H, D], stride, first) -> (x8 [m, H, D] float8_e4m3fn, scale [rows, H] float32)

x[i] is the token at position first + i. Strided row r holds the positions (first // stride + r) * stride ...
+ stride - 1 (the tokens one row of the estimate concatenates), rows = (first + m - 1) // stride - first // stride + 1.
scale[r, h] = amax over the row's tokens and dims of head h / 448 (448: e4m3fn's largest finite value) and
x8 = x / scale, so every row uses the whole fp8 range; a row of zeros gets scale 0 and fp8 zeros.

Why per strided row: the estimate's score of strided row i and column j is a sum of products of q's row-i tokens
with k's column-j tokens, so score = scale_q[i] * scale_k[j] * (the same sum over the fp8 values): the scales leave
the dot products, and the kernel applies them once per score tile, after its last offset. On sm_89+ tensor cores an
fp8 product runs at twice the 16-bit rate and its operands are half the bytes.
"""
from __future__ import annotations

import torch

from sparsekv.kernels._dispatch import HAS_TRITON, cdiv, jit, next_power_of_2, tl, triton_interpret, use_triton
from sparsekv.kernels.fp8_kv import FP8_DTYPE, FP8_MAX, round_to_e4m3

__all__ = ["dequantize_strided", "quantize_strided", "quantize_strided_reference", "strided_rows"]

# elements of x one program quantizes (BLOCK_R rows of stride * D) and its warps, by tools/tune_xattn.py --sections
# estimate (q and k of an 8K chunk at the end of 512K keys, NVIDIA H200, 2026-11-29): 8,192 at 4 warps 0.538 ms
# (3.18 TB/s), 4,096 at 4 0.550, 8,192 at 8 0.554, 16,384 at 8 0.628, 32,768 at 8 0.723
ROW_TILE_ELEMENTS = 8192
QUANTIZE_WARPS = 4


def strided_rows(m: int, stride: int, first: int) -> int:
    """Strided rows covering positions first ... first + m - 1."""
    return 0 if m == 0 else (first + m - 1) // stride - first // stride + 1


def _check(x: torch.Tensor, stride: int, first: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.dtype.is_floating_point:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize_strided: expected a floating x [m, H, D]; got {shape}")
    for name, value, minimum in (("stride", stride, 1), ("first", first, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"quantize_strided: {name}={value!r} must be an integer >= {minimum}")


def quantize_strided_reference(x: torch.Tensor, stride: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch quantize_strided (the module docstring's definition)."""
    _check(x, stride, first)
    m, heads, dim = x.shape
    rows, lead = strided_rows(m, stride, first), first % stride
    padded = x.new_zeros(rows * stride, heads, dim, dtype=torch.float32)  # [rows * stride, H, D]
    padded[lead:lead + m] = x.float()
    amax = padded.view(rows, stride, heads, dim).abs().amax(dim=(1, 3))  # [rows, H]
    inv = torch.where(amax > 0, FP8_MAX / amax, torch.zeros_like(amax))
    scaled = padded.view(rows, stride, heads, dim) * inv[:, None, :, None]
    x8 = scaled.clamp_(-FP8_MAX, FP8_MAX).view(rows * stride, heads, dim)[lead:lead + m].to(FP8_DTYPE)
    return x8, amax / FP8_MAX


@jit(do_not_specialize=["m", "lead", "rows"])
def _quantize_strided_kernel(
    X, X8, SCALE,
    stride_xm, stride_xh, stride_om, stride_oh, stride_sr,
    m, lead, rows,
    STRIDE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    EMULATE_ROUNDING: tl.constexpr,
):
    # one program per (tile of BLOCK_R strided rows, head); a row's STRIDE tokens side by side: [BLOCK_R, STRIDE * D]
    tile = tl.program_id(0)
    head = tl.program_id(1)
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] strided rows
    c = tl.arange(0, STRIDE * BLOCK_D)  # [STRIDE * BLOCK_D] (token of the row, dim)
    tok = r[:, None] * STRIDE + (c // BLOCK_D)[None, :] - lead  # [BLOCK_R, STRIDE * BLOCK_D] rows of x
    dim = (c % BLOCK_D)[None, :]
    ok = (tok >= 0) & (tok < m) & (dim < D)
    x = tl.load(X + head.to(tl.int64) * stride_xh + tok.to(tl.int64) * stride_xm + dim, mask=ok,
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_R]
    inv = tl.where(amax > 0.0, 448.0 / tl.maximum(amax, 1e-30), 0.0)  # 448: FP8_MAX
    y = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    if EMULATE_ROUNDING:  # the interpreter's cast mis-rounds; the GPU's cvt rounds to nearest even itself
        y = round_to_e4m3(y)
    tl.store(X8 + head.to(tl.int64) * stride_oh + tok.to(tl.int64) * stride_om + dim, y.to(X8.dtype.element_ty),
             mask=ok)
    tl.store(SCALE + r.to(tl.int64) * stride_sr + head, amax / 448.0, mask=r < rows)


def quantize_strided(x: torch.Tensor, stride: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, H, D] -> (x8 [m, H, D] float8_e4m3fn, scale [rows, H] float32); see the module docstring. One Triton
    launch on CUDA (or on CPU under TRITON_INTERPRET=1), else the reference. No host sync."""
    _check(x, stride, first)
    m, heads, dim = x.shape
    if not (HAS_TRITON and use_triton(x.device)) or m == 0 or dim == 0 or x.stride(2) != 1 \
            or stride & (stride - 1):
        return quantize_strided_reference(x, stride, first)
    rows = strided_rows(m, stride, first)
    x8 = torch.empty(m, heads, dim, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, heads, dtype=torch.float32, device=x.device)
    block_d = max(16, next_power_of_2(dim))
    block_r = max(1, min(64, ROW_TILE_ELEMENTS // (stride * block_d)))
    _quantize_strided_kernel[(cdiv(rows, block_r), heads)](
        x, x8, scale, x.stride(0), x.stride(1), x8.stride(0), x8.stride(1), scale.stride(0),
        m, first % stride, rows, STRIDE=stride, D=dim, BLOCK_D=block_d, BLOCK_R=block_r,
        EMULATE_ROUNDING=triton_interpret(), num_warps=QUANTIZE_WARPS)
    return x8, scale


def dequantize_strided(x8: torch.Tensor, scale: torch.Tensor, stride: int, first: int) -> torch.Tensor:
    """quantize_strided's (x8, scale) -> float32 [m, H, D]."""
    rows = (torch.arange(x8.shape[0], device=x8.device) + first % stride) // stride  # [m] strided row of each token
    return x8.float() * scale[rows][:, :, None]
