"""OffloadEngine: the only code that copies KV between host and device.

GPU side (fixed size, independent of context length):
  ring slots    k/v [num_gpu_blocks, block_size, KVH, D]   host blocks loaded for attention, no layer dim
  prefill buf   k/v [L, prefill_tokens, KVH, D]            this step's chunk, offloaded asynchronously
  decode buf    k/v [max_seqs, L, block_size, KVH, D]      each running sequence's unfinished block
Streams: loads (H2D) and offloads (D2H) each have their own copy stream; events order them against compute:
a slot is reloaded only after the attention that read it, and a layer's buffers are rewritten only after
their previous offload finished. Nothing here waits on the host, so the CPU runs ahead of the GPU and the ring
keeps loading layer L+1's blocks while layer L computes.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

import torch

from sparsekv.kvcache.host_pool import HostPool


class _Streams:
    """CUDA streams and events; on CPU every copy is synchronous and these are no-ops."""

    def __init__(self, device: torch.device, num_slots: int, num_layers: int):
        self.cuda = device.type == "cuda"
        if not self.cuda:
            return
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.slot_loaded = [torch.cuda.Event() for _ in range(num_slots)]
        self.slot_free = [torch.cuda.Event() for _ in range(num_slots)]
        self.layer_offloaded = [torch.cuda.Event() for _ in range(num_layers)]
        self.layer_written = [torch.cuda.Event() for _ in range(num_layers)]


class OffloadEngine:
    def __init__(self, host: HostPool, num_gpu_blocks: int, prefill_tokens: int, max_num_seqs: int,
                 device: torch.device, policy_hooks=()):
        self.host = host
        self.device = device
        self.block_size = host.block_size
        self.num_slots = num_gpu_blocks
        L, bs, kvh, d, dtype = host.num_layers, host.block_size, host.num_kv_heads, host.head_dim, host.dtype
        self.k_slots = torch.empty((num_gpu_blocks, bs, kvh, d), dtype=dtype, device=device)
        self.v_slots = torch.empty_like(self.k_slots)
        self.prefill_k = torch.empty((L, prefill_tokens, kvh, d), dtype=dtype, device=device)
        self.prefill_v = torch.empty_like(self.prefill_k)
        self.decode_k = torch.empty((max_num_seqs, L, bs, kvh, d), dtype=dtype, device=device)
        self.decode_v = torch.empty_like(self.decode_k)
        self.streams = _Streams(device, num_gpu_blocks, L)
        self.policy_hooks = list(policy_hooks)  # policies whose on_*_offload hooks see offloaded keys
        self.next_slot = 0
        self.block_bytes = bs * kvh * d * dtype.itemsize  # one of K or V, one layer
        self.transfer_stats = {"h2d_bytes": 0, "d2h_bytes": 0, "h2d_blocks": 0, "d2h_blocks": 0}

    # ---- ring of GPU slots: load, wait, read, release
    def load_to_slot_layer(self, slot: int, layer: int, cpu_block: int) -> None:
        host_k, host_v = self.host.block(layer, cpu_block)
        s = self.streams
        if s.cuda:
            with torch.cuda.stream(s.h2d):
                s.h2d.wait_event(s.slot_free[slot])  # the attention that last read this slot is done
                s.h2d.wait_event(s.layer_offloaded[layer])  # the block reached the host
                self.k_slots[slot].copy_(host_k, non_blocking=True)
                self.v_slots[slot].copy_(host_v, non_blocking=True)
                s.slot_loaded[slot].record(s.h2d)
        else:
            self.k_slots[slot].copy_(host_k)
            self.v_slots[slot].copy_(host_v)
        self.transfer_stats["h2d_bytes"] += 2 * self.block_bytes
        self.transfer_stats["h2d_blocks"] += 1

    def wait_slot_layer(self, slot: int) -> None:
        if self.streams.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.streams.slot_loaded[slot])

    def get_kv_for_slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_slots[slot], self.v_slots[slot]  # [block_size, KVH, D] each

    def record_slot_compute_done(self, slot: int) -> None:
        if self.streams.cuda:
            self.streams.slot_free[slot].record(torch.cuda.current_stream(self.device))

    def stream_blocks(self, layer: int, cpu_blocks: list[int]) -> Iterator[tuple[int, int]]:
        """Yield (slot, cpu_block) in order, each loaded and waited for, keeping up to num_slots loads in
        flight. The caller reads the slot and calls record_slot_compute_done(slot) before the next item."""
        pending: deque[tuple[int, int]] = deque()
        blocks = iter(cpu_blocks)
        for block in blocks:
            pending.append((self._issue(layer, block), block))
            if len(pending) == self.num_slots:
                break
        while pending:
            slot, block = pending.popleft()
            self.wait_slot_layer(slot)
            yield slot, block
            following = next(blocks, None)
            if following is not None:
                pending.append((self._issue(layer, following), following))

    def _issue(self, layer: int, cpu_block: int) -> int:
        slot = self.next_slot
        self.next_slot = (slot + 1) % self.num_slots
        self.load_to_slot_layer(slot, layer, cpu_block)
        return slot

    # ---- prefill buffer: the chunk being written
    def ensure_prefill_capacity(self, num_tokens: int) -> None:
        """Layerwise prefill holds a whole prompt per layer; chunked prefill never grows this."""
        if num_tokens > self.prefill_k.shape[1]:
            self.synchronize()
            shape = (self.prefill_k.shape[0], num_tokens, *self.prefill_k.shape[2:])
            self.prefill_k = torch.empty(shape, dtype=self.prefill_k.dtype, device=self.device)
            self.prefill_v = torch.empty_like(self.prefill_k)

    def get_prefill_buffer_slice(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prefill_k[layer, :n], self.prefill_v[layer, :n]

    def write_prefill_buffer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v [N, KVH, D]
        self.wait_prefill_offload(layer)
        n = k.shape[0]
        self.prefill_k[layer, :n].copy_(k)
        self.prefill_v[layer, :n].copy_(v)
        self._mark_written(layer)

    def offload_prefill_buffer_async(self, layer: int, cpu_block: int, n: int, start: int = 0) -> None:
        """Rows [start, start+n) of the layer's prefill buffer become host block `cpu_block` (n <= block_size)."""
        keys = self.prefill_k[layer, start:start + n]
        for policy in self.policy_hooks:
            policy.on_prefill_offload(cpu_block, layer, keys, n)
        self._offload(layer, cpu_block, keys, self.prefill_v[layer, start:start + n])

    def wait_prefill_offload(self, layer: int) -> None:
        if self.streams.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.streams.layer_offloaded[layer])

    # ---- decode buffer: each sequence's unfinished block
    def get_decode_layer_kv(self, row: int, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_k[row, layer, :n], self.decode_v[row, layer, :n]  # [n, KVH, D]

    def write_decode_tokens(self, layer: int, rows: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor) -> None:
        # rows, offsets [B] int64 on device; k, v [B, KVH, D]
        self.wait_prefill_offload(layer)
        self.decode_k[:, layer].index_put_((rows, offsets), k)
        self.decode_v[:, layer].index_put_((rows, offsets), v)
        self._mark_written(layer)

    def copy_prefill_tail_to_decode(self, layer: int, row: int, start: int, n: int) -> None:
        """The partial last block of a finished prefill continues in the sequence's decode buffer."""
        self.decode_k[row, layer, :n].copy_(self.prefill_k[layer, start:start + n])
        self.decode_v[row, layer, :n].copy_(self.prefill_v[layer, start:start + n])

    def offload_decode_buffer_async(self, layer: int, row: int, cpu_block: int) -> None:
        keys = self.decode_k[row, layer]
        for policy in self.policy_hooks:
            policy.on_decode_offload(cpu_block, layer, keys, self.block_size)
        self._offload(layer, cpu_block, keys, self.decode_v[row, layer])

    # ---- shared
    def _mark_written(self, layer: int) -> None:
        if self.streams.cuda:
            self.streams.layer_written[layer].record(torch.cuda.current_stream(self.device))

    def _offload(self, layer: int, cpu_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        host_k, host_v = self.host.block(layer, cpu_block)
        s = self.streams
        if s.cuda:
            with torch.cuda.stream(s.d2h):
                s.d2h.wait_event(s.layer_written[layer])
                host_k[:n].copy_(k, non_blocking=True)
                host_v[:n].copy_(v, non_blocking=True)
                s.layer_offloaded[layer].record(s.d2h)
        else:
            host_k[:n].copy_(k)
            host_v[:n].copy_(v)
        self.transfer_stats["d2h_bytes"] += 2 * n * self.block_bytes // self.block_size
        self.transfer_stats["d2h_blocks"] += 1

    def synchronize(self) -> None:
        if self.streams.cuda:
            self.streams.h2d.synchronize()
            self.streams.d2h.synchronize()
