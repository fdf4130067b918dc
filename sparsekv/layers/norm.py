from __future__ import annotations

import functools

import torch
from torch import nn

from sparsekv.kernels.backend import KernelChoice
from sparsekv.kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference


class RMSNorm(nn.Module):
    """HF-compatible RMSNorm: normalise in fp32, cast back, then scale (sparsekv/kernels/rmsnorm.py: one Triton
    kernel where kernels.triton, else its torch reference)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, kernels: KernelChoice):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        if kernels.triton:
            self._norm = functools.partial(rms_norm, pdl=kernels.pdl)
            self._add_norm = functools.partial(add_rms_norm, pdl=kernels.pdl)
        else:
            self._norm, self._add_norm = rms_norm_reference, add_rms_norm_reference

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., dim] -> normed; with `residual`: (rms_norm(x + residual), x + residual), the add fused."""
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)
