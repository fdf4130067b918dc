from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsekv.kernels._dispatch import use_triton_gemv
from sparsekv.kernels.gemv import MAX_M, skinny_linear


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose few-row inputs (decode) run the Triton skinny-GEMV
    kernel where :func:`sparsekv.kernels._dispatch.use_triton_gemv` says so (by default: one row, on CUDA);
    otherwise F.linear (cuBLAS)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in_features] -> [..., out_features]
        rows = x.numel() // self.in_features if self.in_features else 0
        if use_triton_gemv(x.device, rows, MAX_M):
            out = skinny_linear(x.reshape(rows, self.in_features), self.weight, self.bias)  # [rows, out_features]
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)
