"""Fused RMSNorm, and residual add + RMSNorm, over the last dimension.

Semantics (HF's, and the torch references below, which the model's torch path runs):

    rms_norm(x, w)          = w * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype),   x32 = x.float()
    add_rms_norm(x, r, w)   = (rms_norm(x + r, w), x + r)                           x + r in x's dtype

i.e. normalise in fp32, round to the input dtype, then multiply by the weight in promote(weight, x) dtype (the
product of two bf16/fp16 values is exact in fp32, so the kernel's fp32 multiply + round equals torch's). The
residual sum is rounded to x's dtype before it is normalised, as ``hidden + attn_out`` followed by the norm is
today.

The kernel runs one program per row with fp32 accumulation: rows up to MAX_ONE_PASS elements stay in registers
(one read of x, one write); longer rows loop over chunks twice (sum of squares, then normalise).
Launches allocate their outputs with fixed shapes and never sync with the host: safe inside CUDA graphs.
"""

from __future__ import annotations

import torch

from ._dispatch import (
    alloc_output,
    jit,
    next_power_of_2,
    pdl_launch_options,
    pdl_wait,
    tl,
)

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]

MAX_ONE_PASS = 8192  # row elements (power of two) one program holds in registers
CHUNK = 4096  # elements per step of the two-pass loop for longer rows
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------- references
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-compatible RMSNorm of x [..., N] with weight [N]: normalise in fp32, cast back, then scale."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum in x's dtype."""
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


# ---------------------------------------------------------------------------------------------- kernel
@jit
def _rms_norm_kernel(
    X, R, W, OUT, RES_OUT,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    r_row = R + row * stride_r
    o_row = OUT + row * stride_o
    ro_row = RES_OUT + row * stride_ro
    act = X.dtype.element_ty
    if ONE_PASS:
        offs = tl.arange(0, BLOCK_N)
        ok = offs < N
        x = tl.load(x_row + offs, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_row + offs, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(act)  # the residual stream, rounded like torch's add
            tl.store(ro_row + offs, x, mask=ok)
        x32 = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
        xn = (x32 * inv).to(act).to(tl.float32)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(o_row + offs, (w * xn).to(OUT.dtype.element_ty), mask=ok)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            ok = offs < N
            x = tl.load(x_row + offs, mask=ok, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_row + offs, mask=ok, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(act)
                tl.store(ro_row + offs, x, mask=ok)
            x32 = x.to(tl.float32)
            acc += x32 * x32
        inv = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            ok = offs < N
            x = tl.load(x_row + offs, mask=ok, other=0.0)
            if HAS_RESIDUAL:  # recompute the sum rather than read back what other threads stored
                r = tl.load(r_row + offs, mask=ok, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(act)
            xn = (x.to(tl.float32) * inv).to(act).to(tl.float32)
            w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(o_row + offs, (w * xn).to(OUT.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------- launchers
def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm expects x [..., N] and weight [N]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if not x.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise ValueError(f"rms_norm expects floating x and weight; got x {x.dtype}, weight {weight.dtype} "
                         f"(x {tuple(x.shape)})")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} is on {x.device}, weight on {weight.device}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"add_rms_norm expects residual like x {tuple(x.shape)} {x.dtype} on {x.device}; "
                             f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}")


def _check_kernel_dtypes(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in KERNEL_DTYPES or weight.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the Triton rms_norm supports {KERNEL_DTYPES}; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {weight.dtype}")


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)  # a view for the model's [T, N] activations
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def norm_warps(block: int) -> int:
    """Warps of a one-row norm program over `block` elements; kernels that must round and reduce as this one does
    (sparsekv.kernels.linear_norm) launch with the same count."""
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, pdl: bool):
    n = x.shape[-1]
    x2 = _rows(x, n)
    rows = x2.shape[0]
    out = alloc_output((rows, n), torch.promote_types(x.dtype, weight.dtype), x.device)
    res_out = alloc_output((rows, n), x.dtype, x.device) if residual is not None else None
    if rows > 0 and n > 0:
        r2 = _rows(residual, n) if residual is not None else x2
        one_pass = next_power_of_2(n) <= MAX_ONE_PASS
        block = next_power_of_2(n) if one_pass else CHUNK
        warps = norm_warps(block)
        ro = res_out if res_out is not None else out
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, ro,
            x2.stride(0), r2.stride(0), out.stride(0), ro.stride(0),
            n, float(eps),
            HAS_RESIDUAL=residual is not None, ONE_PASS=one_pass, BLOCK_N=block, num_warps=warps,
            **pdl_launch_options(pdl),
        )
    elif n == 0 and residual is not None:
        res_out = x + residual
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False) -> torch.Tensor:
    """RMSNorm of x [..., N] over its last dim with weight [N] -> [..., N] in promote(x, weight) dtype: the Triton
    kernel (``pdl``: launched with programmatic dependent launch)."""
    _check(x, weight)
    _check_kernel_dtypes(x, weight)
    return _launch(x, None, weight, eps, pdl)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual): new_residual = x + residual (x's dtype), normed = rms_norm(new_residual)."""
    _check(x, weight, residual)
    _check_kernel_dtypes(x, weight)
    return _launch(x, residual, weight, eps, pdl)
