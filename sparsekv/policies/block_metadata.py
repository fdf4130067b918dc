"""Per-host-block metadata that selection policies keep on the device, indexed by cpu block id.

Policies (Quest's key bounds, XAttention's key summaries) record a few small tensors per host block while the
block's keys are still on the GPU (SparsePolicy.on_prefill_offload / on_decode_offload) and read them when they
choose blocks, without loading the blocks. The table lives on the device: initialize() gets the host pool's block
count, an upper bound that may be far larger than what the running sequences use, and the number of blocks they
can hold at once (KVLayout.expected_blocks), which is allocated up front: the engine reserves that much device
memory for it (SparsePolicy.device_bytes_per_block), and a table that never grows keeps GPU memory fixed while the
engine runs.
"""
from __future__ import annotations

import torch


class BlockMetadata:
    """A tensor [num_layers, capacity, *item_shape] on `device`, indexed by (layer, cpu block id).

    `capacity` starts at `rows` and grows (doubling, at least to the id written) when a block id beyond it
    arrives; rows never written read as `fill`.
    """

    MIN_CAPACITY = 16

    def __init__(self, num_layers: int, item_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 max_blocks: int | None = None, fill: float = 0.0, rows: int = 0):
        self.num_layers = num_layers
        self.item_shape = tuple(item_shape)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_blocks = max_blocks
        self.fill = fill
        rows = min(rows, max_blocks) if max_blocks else rows
        self.data = torch.full((num_layers, rows, *self.item_shape), fill, dtype=dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def bytes_per_block(self) -> int:
        """Device bytes per host block, all layers."""
        numel = self.num_layers
        for size in self.item_shape:
            numel *= size
        return numel * self.data.element_size()

    def ensure(self, block_id: int) -> None:
        """Make row `block_id` exist (grows the table; the host pool's size caps the doubling, never the id)."""
        if block_id < self.capacity:
            return
        capacity = max(block_id + 1, 2 * self.capacity, self.MIN_CAPACITY)
        if self.max_blocks:
            capacity = max(block_id + 1, min(capacity, self.max_blocks))
        grown = torch.full((self.num_layers, capacity, *self.item_shape), self.fill, dtype=self.dtype,
                           device=self.device)
        grown[:, :self.capacity] = self.data
        self.data = grown

    def write(self, layer: int, block_id: int, value: torch.Tensor) -> None:
        """data[layer, block_id] = value (an item_shape tensor on the device)."""
        self.ensure(block_id)
        self.data[layer, block_id] = value

    def gather(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """[len(block_ids), *item_shape] for int64 ids on the device (all previously written)."""
        return self.data[layer].index_select(0, block_ids)
