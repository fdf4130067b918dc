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

    def kv_write_target(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache, slot_mapping) where this step's k/v may be stored before forward(kv_written=True),
        where the step's KV store offers it (the device-resident paged store); else None."""
        context = get_context()
        target = getattr(context.kv_store, "kv_write_target", None)
        return target(self.layer_id, context) if target is not None else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool = False) -> torch.Tensor:
        # q [N, H, D], k/v [N, KVH, D] -> [N, H, D]; kv_written: k/v are already at kv_write_target's slots
        context = get_context()
        if kv_written:
            return context.kv_store.attend(self.layer_id, q, k, v, self.scale, context, kv_written=True)
        return context.kv_store.attend(self.layer_id, q, k, v, self.scale, context)
