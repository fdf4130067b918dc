from __future__ import annotations

import torch
from torch import nn

from sparsekv.engine.context import get_context


class Attention(nn.Module):
    """Hands q/k/v of the current step to the KV store, which writes the new keys and attends."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [N, H, D], k/v [N, KVH, D] -> [N, H, D]
        context = get_context()
        return context.kv_store.attend(self.layer_id, q, k, v, self.scale, context)
