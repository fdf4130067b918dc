"""A decode step's linear layer followed by the residual add and the next RMSNorm, in two launches.

    linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps, gated=False) -> (normed, new_residual)
        out          = x @ weight^T + bias                       (gated: silu(gate) * up of x, as silu_mul_linear)
        new_residual = out + residual                            (rounded to x's dtype, as add_rms_norm)
        normed       = rms_norm(new_residual, norm_weight, eps)

exactly add_rms_norm(skinny_linear(x, weight, bias), residual, norm_weight, eps): the skinny GEMV
(sparsekv.kernels.gemv) writes its fp32 per-split sums, and one program per row then sums them in split order, adds
the bias, rounds (the values the GEMV's own split-K reduction would give), adds the residual and normalises, with
the operations and roundings of sparsekv.kernels.rmsnorm. The separate split-K reduction and the norm kernel were two
~2 us latency-bound launches after the o projection and after the down projection of every layer; this is one.

Used by the model's fused decode forward where the skinny GEMV and the fused elementwise kernels run (a few rows,
Triton); elsewhere it computes the same thing with the separate ops.
"""

from __future__ import annotations

import torch

from ._dispatch import alloc_output, jit, next_power_of_2, pdl_launch_options, pdl_wait, tl
from .gemv import (
    _check,
    _kernel_applies,
    silu_mul_linear,
    silu_mul_linear_reference,
    skinny_linear,
    skinny_linear_reference,
    skinny_linear_triton,
)
from .rmsnorm import KERNEL_DTYPES, MAX_ONE_PASS, add_rms_norm, add_rms_norm_reference, norm_warps
from .rmsnorm import _check as _check_norm

__all__ = ["linear_add_rms_norm", "linear_add_rms_norm_reference"]


@jit
def _reduce_add_rms_norm_kernel(
    P, B, R, NW, OUT, RES_OUT,
    stride_r, stride_o, stride_ro,
    M, N, eps,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    # P: fp32 partials [SPLIT_K, M, N] contiguous; row m of the result from P[:, m]
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ok = offs < N
    # weights before the wait (no kernel writes them): their loads overlap the previous kernel's tail
    w = tl.load(NW + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(B + offs, mask=ok, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    r = tl.load(R + row * stride_r + offs, mask=ok, other=0.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # split order, as the GEMV's split-K reduction; unrolled: loads in flight
        acc += tl.load(P + s * M * N + row * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += bias
    act = R.dtype.element_ty
    out = acc.to(act)  # the linear layer's output, rounded
    x = (out.to(tl.float32) + r.to(tl.float32)).to(act)  # the residual stream, rounded like torch's add
    tl.store(RES_OUT + row * stride_ro + offs, x, mask=ok)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    xn = (x32 * inv).to(act).to(tl.float32)
    tl.store(OUT + row * stride_o + offs, (w * xn).to(OUT.dtype.element_ty), mask=ok)


def linear_add_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                  residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                  gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch: add_rms_norm_reference(linear(x) in fp32, rounded once; residual) -> (normed, new_residual)."""
    out = (silu_mul_linear_reference if gated else skinny_linear_reference)(x, weight, bias)
    return add_rms_norm_reference(out, residual, norm_weight, eps)


def _separate(x, weight, bias, residual, norm_weight, eps, gated, pdl=False):
    """The separate ops (each its kernel or its torch fallback): what the fused launch computes."""
    out = (silu_mul_linear if gated else skinny_linear)(x, weight, bias, pdl=pdl)
    return add_rms_norm(out, residual, norm_weight, eps, pdl=pdl)


def _fusable(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    n = weight.shape[0]
    return (_kernel_applies(x, weight) and next_power_of_2(n) <= MAX_ONE_PASS
            and residual.stride(-1) == 1 and norm_weight.dtype in KERNEL_DTYPES)


def linear_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float, gated: bool = False, *, pdl: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (gated: gate_up [M, 2K]), weight [N, K], residual [M, N], norm_weight [N] -> (normed [M, N] in
    promote(x, norm_weight) dtype, new_residual [M, N] in x's dtype); see the module docstring. ``pdl``: both
    launches use programmatic dependent launch."""
    _check(x, weight, bias, gated)
    m, n = x.shape[0], weight.shape[0]
    if residual.shape != (m, n):
        raise ValueError(f"linear_add_rms_norm: residual {tuple(residual.shape)} must be [M={m}, N={n}] "
                         f"(x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    if residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"linear_add_rms_norm: residual is {residual.dtype} on {residual.device}; expected x's "
                         f"{x.dtype} on {x.device}")
    _check_norm(residual, norm_weight)
    if not _fusable(x, weight, residual, norm_weight):
        return _separate(x, weight, bias, residual, norm_weight, eps, gated, pdl)
    partials = skinny_linear_triton(x, weight, None, gated=gated, partials=True, pdl=pdl)  # [S, M, N] fp32
    normed = alloc_output((m, n), torch.promote_types(x.dtype, norm_weight.dtype), x.device)  # [M, N]
    new_residual = alloc_output((m, n), x.dtype, x.device)  # [M, N]
    block = next_power_of_2(n)
    _reduce_add_rms_norm_kernel[(m,)](
        partials, bias if bias is not None else partials, residual, norm_weight, normed, new_residual,
        residual.stride(0), normed.stride(0), new_residual.stride(0),
        m, n, float(eps),
        SPLIT_K=partials.shape[0], HAS_BIAS=bias is not None, BLOCK_N=block, num_warps=norm_warps(block),
        **pdl_launch_options(pdl),
    )
    return normed, new_residual
