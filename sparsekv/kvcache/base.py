"""The interface both KV stores (GPU-resident paged, CPU-offloaded) give the engine and the attention layers."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sparsekv.engine.context import Context


class KVStore(ABC):
    block_size: int
    num_blocks: int  # blocks the block manager may hand out
    bytes_per_block: int  # K and V of one block, all layers
    prefill_token_budget: int | None = None  # tokens per prefill step, when the store fixes it
    chunk_alignment: int = 1  # unfinished prefill chunks end on a multiple of this
    # Can decode step N+1 be launched before step N's tokens are read (scheduler.async_decode)? Only when a step is
    # plain kernels on the compute stream, with no host state that needs step N's results (sparsekv/engine/overlap.py).
    overlapped_decode_safe: bool = False
    chunk_tokens: int | None = None  # offload=cpu: tokens per prefill chunk the store computes at once
    scratch_slot: int | None = None  # offload=none: a slot that padded rows of a captured batch write into

    @property
    def transfer_stats(self) -> dict[str, int]:
        """Host<->device KV traffic so far (h2d/d2h bytes and blocks); empty for a store that moves none."""
        return {}

    @property
    def cache_stats(self) -> dict[str, int]:
        """GPU block cache counters (offload=cpu with offload.gpu_cache_gib); empty for a store without one."""
        return {}

    def reserve(self, num_tokens: int) -> float:
        """Allocate what `num_tokens` tokens of KV will need now rather than during the first prefill; returns the
        seconds spent (0 for a store whose memory is allocated up front)."""
        return 0.0

    def begin_step(self, context: Context) -> None:
        """Called before the model runs a step (offload: start the decode pipeline)."""

    def end_step(self, context: Context) -> None:
        """Called after the last layer of a step (offload: wait for pending offloads)."""

    @abstractmethod
    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               context: Context) -> torch.Tensor:
        """Store this step's k/v [N, KVH, D] for `layer_id` and return attention of q [N, H, D] -> [N, H, D]."""

    def capacity_hint(self) -> str:
        """What the user can change to get more KV capacity."""
        return "raise offload.num_kv_blocks or offload.gpu_memory_utilization, or use offload=cpu"

    def release(self, seq) -> None:
        """A sequence left (finished or aborted): forget per-sequence state."""


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """A prefill step's attention output [N, H, D] from its sequences' parts in row order: a step of one sequence
    (a long prompt, the usual case) hands its part on as it is, without a copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def format_bytes(num_bytes: float) -> str:
    """GiB from 1 GiB up, MiB below (so a small figure does not read "0.00 GiB")."""
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB"
    return f"{num_bytes / (1 << 20):.2f} MiB"


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
