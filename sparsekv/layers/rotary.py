"""Rotary position embedding (HF's rotate-half layout) with Llama 3 frequency scaling."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from sparsekv.kernels.backend import KernelChoice
from sparsekv.kernels.rotary import rotary_cos_sin_reference, rotary_embed_reference


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling factor for a rope_scaling config."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq, 1.0
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        original_max = scaling.get("original_max_position_embeddings", 8192)
        low_freq_wavelen = original_max / low_freq_factor
        high_freq_wavelen = original_max / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: default, llama3, linear")


class Rope(NamedTuple):
    """What every layer's rotary needs for one forward: the positions and frequencies, and on the torch path the
    cos/sin tables [N, D] (built once per forward). The Triton path leaves them None: its fused q/k norm + rotary
    kernel computes cos/sin from the positions (sparsekv/kernels/rotary.py)."""
    positions: torch.Tensor  # [N] integer
    inv_freq: torch.Tensor  # [D/2] fp32
    attention_scaling: float
    cos: torch.Tensor | None = None  # [N, D] in the activation dtype
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, *, kernels: KernelChoice):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.fused = kernels.triton

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """positions [N] -> the step's Rope; cos/sin tables only where the fused kernel does not run."""
        if self.fused:
            return Rope(positions, self.inv_freq, self.attention_scaling)
        return Rope(positions, self.inv_freq, self.attention_scaling, *self.cos_sin(positions, dtype))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin_reference(positions, self.inv_freq, self.attention_scaling, dtype)  # [N, D] each

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [N, heads, D], cos/sin [N, D]
        return rotary_embed_reference(x, cos, sin)
