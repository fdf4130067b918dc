"""Pinned host memory for KV blocks, grown in slabs as sequences grow (start-up cost does not scale with the
maximum context). Each slab is laid out [layer, block, block_size, kv_heads, head_dim]."""
from __future__ import annotations

import torch

GIB = 1 << 30


class HostPool:
    def __init__(self, num_layers: int, max_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin_memory: bool, slab_bytes: int = 1 * GIB):
        self.num_layers, self.block_size = num_layers, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.max_blocks = max_blocks
        self.pin_memory = pin_memory
        self.bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        # K and V slabs are separate allocations of slab_bytes at most each: torch's pinned allocator rounds every
        # request up to a power of two, so a power-of-two slab_bytes wastes at most one block's worth per slab
        self.blocks_per_slab = max(1, min(max_blocks, slab_bytes // (self.bytes_per_block // 2)))
        self.k_slabs: list[torch.Tensor] = []  # each [L, blocks_per_slab, block_size, KVH, D]
        self.v_slabs: list[torch.Tensor] = []
        self.generation = 0  # bumped whenever slabs come or go: device-side slab addresses must be remade

    @property
    def capacity(self) -> int:
        return len(self.k_slabs) * self.blocks_per_slab

    def ensure_capacity(self, num_blocks: int) -> None:
        """Allocate slabs until block ids [0, num_blocks) exist."""
        if num_blocks > self.max_blocks:
            raise ValueError(f"host KV pool holds {self.max_blocks} blocks, {num_blocks} requested")
        shape = (self.num_layers, self.blocks_per_slab, self.block_size, self.num_kv_heads, self.head_dim)
        while self.capacity < num_blocks:
            self.k_slabs.append(torch.empty(shape, dtype=self.dtype, pin_memory=self.pin_memory))
            self.v_slabs.append(torch.empty(shape, dtype=self.dtype, pin_memory=self.pin_memory))
            self.generation += 1

    # ---- growth and release: memory follows the blocks in use, not the pool's limit
    @property
    def bytes_allocated(self) -> int:
        """Host bytes the slabs hold (pinned on CUDA)."""
        return sum(slab.numel() * slab.element_size() for slab in self.k_slabs + self.v_slabs)

    def release_slabs(self, keep_blocks: int = 0) -> None:
        """Free the slabs beyond those that hold block ids [0, keep_blocks). Only when no block past keep_blocks is
        in use and no copy reads or writes them (the store calls this when idle, after a synchronize)."""
        keep = -(-keep_blocks // self.blocks_per_slab)
        if len(self.k_slabs) <= keep:
            return
        del self.k_slabs[keep:], self.v_slabs[keep:]
        self.generation += 1
        if self.pin_memory and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # torch keeps freed pinned blocks cached: hand them back to the OS

    def contiguous(self, block_id: int, next_block_id: int) -> bool:
        """Do the two blocks sit next to each other in one slab?"""
        return next_block_id == block_id + 1 and next_block_id % self.blocks_per_slab != 0

    def blocks(self, layer: int, first_block: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host K and V of `count` consecutive blocks of one slab: [count, block_size, KVH, D] each."""
        slab, index = divmod(first_block, self.blocks_per_slab)
        return self.k_slabs[slab][layer, index:index + count], self.v_slabs[slab][layer, index:index + count]

    def block(self, layer: int, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host K and V of one block of one layer: [block_size, KVH, D] each."""
        slab, index = divmod(block_id, self.blocks_per_slab)
        return self.k_slabs[slab][layer, index], self.v_slabs[slab][layer, index]
