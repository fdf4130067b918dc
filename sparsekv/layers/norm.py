from __future__ import annotations

import torch
from torch import nn

from sparsekv.kernels.rmsnorm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """HF-compatible RMSNorm: normalise in fp32, cast back, then scale (sparsekv/kernels/rmsnorm.py: one Triton
    kernel where use_fused_elementwise says so, else its torch reference)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., dim] -> normed; with `residual`: (rms_norm(x + residual), x + residual), the add fused."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
