"""Fused SiLU-and-multiply of a gated MLP: gate_up [..., 2I] -> silu(gate) * up [..., I].

Semantics (the torch reference, which the model's torch path runs): ``F.silu(gate) * up`` in the input dtype:
silu computed in fp32 as g / (1 + exp(-g)) and rounded to the input dtype, then the product rounded again.
One launch, one read of gate_up and one write of the output instead of three kernels and an [N, I]
intermediate; fixed-shape output and no host syncs: safe inside CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import (
    alloc_output,
    cdiv,
    jit,
    next_power_of_2,
    pdl_launch_options,
    pdl_wait,
    tl,
)
from .rmsnorm import KERNEL_DTYPES

__all__ = ["silu_and_mul", "silu_and_mul_reference"]

MAX_BLOCK = 1024  # output elements per program
NUM_WARPS = 4


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first, then up) -> F.silu(gate) * up [..., I]."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_and_mul_kernel(GU, OUT, stride_g, stride_o, I, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    g = tl.load(GU + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + I + offs, mask=ok, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu, rounded to the input dtype
    tl.store(OUT + row * stride_o + offs, (act * u).to(dt), mask=ok)


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul expects gate_up [..., 2I] (an even last dim); got {tuple(gate_up.shape)}")
    if not gate_up.dtype.is_floating_point:
        raise ValueError(f"silu_and_mul expects a float gate_up; got {tuple(gate_up.shape)} {gate_up.dtype}")


def silu_and_mul(gate_up: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate_up[..., :I]) * gate_up[..., I:] as a new [..., I] tensor in its dtype: the
    Triton kernel (``pdl``: launched with programmatic dependent launch)."""
    _check(gate_up)
    if gate_up.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the Triton silu_and_mul supports {KERNEL_DTYPES}; got {tuple(gate_up.shape)} "
                         f"{gate_up.dtype}")
    inter = gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * inter)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    rows = g2.shape[0]
    out = alloc_output((rows, inter), gate_up.dtype, gate_up.device)
    if rows > 0 and inter > 0:
        block = min(next_power_of_2(inter), MAX_BLOCK)
        _silu_and_mul_kernel[(rows, cdiv(inter, block))](g2, out, g2.stride(0), out.stride(0), inter, BLOCK=block,
                                                         num_warps=NUM_WARPS, **pdl_launch_options(pdl))
    return out.view(*gate_up.shape[:-1], inter)
