from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsekv.kernels._dispatch import (
    decode_fusion,
    use_fused_elementwise,
    use_triton_gemv,
)
from sparsekv.kernels.activation import silu_and_mul
from sparsekv.kernels.gemv import MAX_M, silu_mul_linear, skinny_linear
from sparsekv.kernels.linear_norm import linear_add_rms_norm


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

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The down projection of a gated MLP: self(silu_and_mul(gate_up)), gate_up [..., 2 * in_features] ->
        [..., out_features]. Where the skinny kernel runs (and the fused elementwise kernels, whose rounding it
        copies), silu(gate) * up is computed as the kernel loads its input: one launch and no [rows, I] tensor."""
        rows = gate_up.numel() // (2 * self.in_features) if self.in_features else 0
        if (decode_fusion() and use_triton_gemv(gate_up.device, rows, MAX_M)
                and use_fused_elementwise(gate_up.device)):
            out = silu_mul_linear(gate_up.reshape(rows, 2 * self.in_features), self.weight, self.bias)
            return out.view(*gate_up.shape[:-1], self.out_features)  # [..., out_features]
        return self(silu_and_mul(gate_up))

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, gated: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(out, residual) of out = self(x) (gated: self.silu_mul_forward(x)), an RMSNorm with its residual add:
        -> (normed, out + residual), each [..., out_features]. Where the skinny kernel and the fused elementwise
        kernels run, the GEMV's split-K reduction, the add and the norm are one launch after it
        (sparsekv.kernels.linear_norm); the same values either way."""
        width = (2 if gated else 1) * self.in_features
        rows = x.numel() // width if width else 0
        if (decode_fusion() and use_triton_gemv(x.device, rows, MAX_M) and use_fused_elementwise(x.device)
                and residual.shape == (*x.shape[:-1], self.out_features)):
            normed, new_residual = linear_add_rms_norm(
                x.reshape(rows, width), self.weight, self.bias, residual.reshape(rows, self.out_features),
                norm.weight, norm.eps, gated=gated)
            return normed.view(residual.shape), new_residual.view(residual.shape)
        return norm(self.silu_mul_forward(x) if gated else self(x), residual)
