"""Hands out KV blocks (device blocks, or host blocks when offloaded). Lowest ids first keeps pools compact."""
from __future__ import annotations

import heapq

from sparsekv.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))  # a heap
        heapq.heapify(self.free_blocks)
        self.high_water = 0  # one past the largest block id ever handed out

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Can the sequence hold `num_tokens` tokens of KV?"""
        return seq.num_blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        needed = seq.num_blocks_for(num_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free_blocks} free")
        for _ in range(needed):
            block = heapq.heappop(self.free_blocks)
            self.high_water = max(self.high_water, block + 1)
            seq.block_table.append(block)

    def deallocate(self, seq: Sequence) -> None:
        for block in seq.block_table:
            heapq.heappush(self.free_blocks, block)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
