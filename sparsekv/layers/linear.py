from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsekv.kernels._dispatch import use_triton_gemv
from sparsekv.kernels.gemv import MAX_M, skinny_linear


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose inputs of at most gemv.MAX_M rows (decode) run the
    Triton skinny-GEMV kernel when SPARSEKV_GEMV=triton and the Triton kernels run on the input's device
    (:func:`sparsekv.kernels._dispatch.use_triton_gemv`); otherwise, and by default, F.linear (cuBLAS)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in_features] -> [..., out_features]
        rows = x.numel() // self.in_features if self.in_features else 0
        if 0 < rows <= MAX_M and use_triton_gemv(x.device):
            out = skinny_linear(x.reshape(rows, self.in_features), self.weight, self.bias)  # [rows, out_features]
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)
