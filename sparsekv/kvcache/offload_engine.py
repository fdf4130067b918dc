"""OffloadEngine: the only code that copies KV between host and device.

GPU side (fixed size, independent of context length):
  ring slots    kv [2, num_gpu_blocks, block_size, KVH, D]  host blocks loaded for attention, no layer dim
  prefill buf   k/v [L, prefill_tokens, KVH, D]            this step's chunk, offloaded asynchronously
  decode buf    k/v [max_seqs, L, block_size, KVH, D]      each running sequence's unfinished block
Streams: loads (H2D) and offloads (D2H) each have their own copy stream; events order them against compute:
a slot is reloaded only after the attention that read it, and a layer's buffers are rewritten only after
their previous offload finished. Nothing here waits on the host, so the CPU runs ahead of the GPU and the ring
keeps loading layer L+1's blocks while layer L computes.

Two ways into the ring: copy engines for block lists the host knows (stream_block_groups), and a gather kernel
reading pinned memory directly for lists that exist only on the device (gather_block_groups: a selection held
on the device, loaded without a host sync). sparsekv.kvcache.reader.RingReader drives both; nothing here knows of
policies.

Decode steps can be captured into CUDA graphs (sparsekv/graphs/offload_graph.py owns the capture): between
start_capture and finish_capture the copy-engine loads become memcpy nodes on a branch of the graph, ordered by
events recorded inside the capture only (a slot's first load waits for the capture's fork event, later ones for
the attention that last read the slot, as in eager steps), nothing waits for offloads, and transfers are counted
into the capture rather than transfer_stats; the runner orders each replay after pending offloads and later loads
after the replay (order_after_offloads / mark_ring_read).

GPU block cache (sparsekv/kvcache/gpu_block_cache.py, offload.gpu_cache_gib): when present, host-known block lists
go through cached_block_groups instead: blocks held in the cache are read in place (runs of consecutive cache slots
are one group), misses are loaded from the host into their cache slots, blocks the cache cannot take stream through
the ring as before, and offloaded blocks are written through into the cache on the offload stream. A batch's
device-side choices are resolved against the cache on the device (resolve_selected): hits read in place, misses
gathered from the host into staging slots. A prefill chunk whose prefix the cache holds in one run of slots is
copied into the slots after the run before its attention (on the compute stream; its write-through is then
skipped), so a policy reads the whole sequence as one view (sequence_view). With the fp8 host tier the cache holds
fp8 blocks and their scales, as the ring does.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

import torch

from sparsekv.kernels.block_gather import gather_host_blocks, slab_word_offsets
from sparsekv.kvcache.cached_loads import CachedLoads
from sparsekv.kvcache.gpu_block_cache import GpuBlockCache
from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.host_quant import FP8_DTYPE, Fp8Ring
from sparsekv.kvcache.ring_streams import RingCapture, Streams


class OffloadEngine(CachedLoads):
    def __init__(self, host: HostPool, num_gpu_blocks: int, prefill_tokens: int, max_num_seqs: int,
                 device: torch.device, model_dtype: torch.dtype | None = None, cache_slots_per_layer: int = 0):
        self.host = host
        self.device = device
        self.block_size = host.block_size
        self.num_slots = num_gpu_blocks
        L, bs, kvh, d, dtype = host.num_layers, host.block_size, host.num_kv_heads, host.head_dim, host.dtype
        # fp8 host blocks (sparsekv.kvcache.host_quant): the ring holds them as they are, with their scales
        self.fp8 = Fp8Ring(host, num_gpu_blocks, model_dtype, device) if dtype == FP8_DTYPE else None
        self.kv_slots = torch.empty((2, num_gpu_blocks, bs, kvh, d), dtype=dtype, device=device)
        dtype = model_dtype or dtype  # the prefill and decode buffers hold the model's K/V
        self.k_slots, self.v_slots = self.kv_slots[0], self.kv_slots[1]  # [num_gpu_blocks, bs, KVH, D] each
        self.prefill_k = torch.empty((L, prefill_tokens, kvh, d), dtype=dtype, device=device)
        self.prefill_v = torch.empty_like(self.prefill_k)
        self.decode_k = torch.empty((max_num_seqs, L, bs, kvh, d), dtype=dtype, device=device)
        self.decode_v = torch.empty_like(self.decode_k)
        self._decode_kv_rows = (self.decode_k.view(-1, kvh, d), self.decode_v.view(-1, kvh, d))  # [max_seqs*L*bs, ...]
        self.streams = Streams(device, num_gpu_blocks, L)
        self.next_slot = 0
        # one of K or V, one layer, as stored on the host (fp8: with its scales)
        self.block_bytes = bs * kvh * d * host.dtype.itemsize + (self.fp8.scale_bytes if self.fp8 else 0)
        self.transfer_stats = {"h2d_bytes": 0, "d2h_bytes": 0, "h2d_blocks": 0, "d2h_blocks": 0}
        self.cache: GpuBlockCache | None = None
        if cache_slots_per_layer > 0:  # cached blocks as the host holds them (fp8: with their scales)
            self.cache = GpuBlockCache(L, cache_slots_per_layer, bs, kvh, d, self.kv_slots.dtype, device,
                                       scaled=self.fp8 is not None)
            self.transfer_stats.update(cache_hit_blocks=0, cache_miss_blocks=0, cache_overflow_blocks=0)
        # [2] int64: resolve_selected's hits and misses, counted on the device (collect_device_counts)
        self.device_counts = torch.zeros(2, dtype=torch.int64, device=device) if self.cache is not None else None
        self.written_early: set[tuple[int, int]] = set()  # (layer, block) this step's sequence_view wrote already
        self._step_start: torch.cuda.Event | None = torch.cuda.Event() if self.streams.cuda else None
        self._slab_offsets: torch.Tensor | None = None  # [2, num_slabs] int64 on the device, for the gather
        self._slab_generation = -1  # the host pool's generation those offsets were made for
        self.capture: RingCapture | None = None  # set while a decode step is captured (start_capture)
        self._device_ids: dict[tuple[int, ...], torch.Tensor] = {}  # block id lists -> [n] int64 on the device
        self.device_ids_generation = 0  # bumped when those are forgotten: graphs captured before must not replay

    # ---- ring of GPU slots: load, wait, read, release (sparsekv.kvcache.reader.RingReader drives these)
    def num_block_groups(self, num_blocks: int, group_size: int | None = None) -> int:
        """How many groups stream_block_groups yields for `num_blocks` blocks."""
        size = group_size or max(1, self.num_slots // 2)
        return -(-num_blocks // size)

    def stream_block_groups(self, layer: int, cpu_blocks: list[int],
                            group_size: int | None = None) -> Iterator[tuple[int, list[int]]]:
        """Yield (first_slot, blocks): groups of up to `group_size` blocks loaded into consecutive slots, so one
        attention call covers the group (get_kv_for_slots). Two groups are in flight: the ring's halves are the
        double buffer. The caller calls record_slots_compute_done(first_slot, len(blocks)) after reading."""
        size = group_size or max(1, self.num_slots // 2)
        groups = [cpu_blocks[i:i + size] for i in range(0, len(cpu_blocks), size)]
        in_flight = max(1, self.num_slots // size)
        pending: deque[tuple[int, list[int]]] = deque()
        for index, group in enumerate(groups):
            if len(pending) == in_flight:
                first, blocks = pending.popleft()
                self.wait_slots(first, len(blocks))
                yield first, blocks
            pending.append((self._issue_group(layer, group, size), group))
        while pending:
            first, blocks = pending.popleft()
            self.wait_slots(first, len(blocks))
            yield first, blocks

    def begin_step(self) -> None:
        """A step starts: cache slots last read before now may be reloaded once the compute stream got here."""
        if self.cache is not None:
            self.cache.begin_step()
            self.written_early.clear()  # each was offloaded in the step that wrote it
            if self._step_start is not None:
                self._step_start.record(torch.cuda.current_stream(self.device))

    def decode_pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode buffer as paged K/V [max_seqs * L, block_size, KVH, D]: block row * L + layer is a sequence's
        unfinished block of one layer."""
        return self.decode_k.flatten(0, 1), self.decode_v.flatten(0, 1)

    def gather_block_groups(self, layer: int, block_ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Like stream_block_groups for host block ids held in a device tensor [n] int64: yields (first_slot, ids)
        with len(ids) blocks gathered into consecutive slots. The gather kernel runs on the compute stream, so it
        is ordered after the attention that last read those slots; the host never sees the ids."""
        if self.streams.cuda and self.capture is None:  # the blocks reached the host
            self.streams.wait_offloaded(torch.cuda.current_stream(self.device), layer)
        offsets = self._device_slab_offsets()
        for start in range(0, len(block_ids), self.num_slots):
            group = block_ids[start:start + self.num_slots]
            first = self._allocate_slots(len(group))
            gather_host_blocks(self.kv_slots, (self.host.k_slabs, self.host.v_slabs), offsets, group, layer, first)
            if self.fp8 is not None:
                self.fp8.gather_scales(layer, group, first)
            self._count_loads(len(group))
            yield first, group

    MAX_DEVICE_ID_LISTS = 1024  # batched decode adds a slot table per layer and layout

    def device_block_ids(self, blocks: list[int]) -> torch.Tensor:
        """[n] int64 on the device holding `blocks`, one copy per distinct list, kept until forget_device_ids()
        (a captured graph reads the tensor it was captured with)."""
        key = tuple(blocks)
        ids = self._device_ids.get(key)
        if ids is None:
            if self.capture is not None:
                raise RuntimeError("OffloadEngine.device_block_ids: a new block list while capturing a CUDA graph; "
                                   "the eager step before the capture must have made it")
            if len(self._device_ids) >= self.MAX_DEVICE_ID_LISTS:
                self.forget_device_ids()
            ids = torch.tensor(key, dtype=torch.int64, pin_memory=self.streams.cuda).to(self.device,
                                                                                       non_blocking=True)
            self._device_ids[key] = ids
        return ids

    def forget_device_ids(self) -> None:
        self._device_ids.clear()
        self.device_ids_generation += 1

    def _device_slab_offsets(self) -> torch.Tensor:
        """Where each host slab starts, for the gather kernel; refreshed when the pool grows (rare)."""
        if self._slab_offsets is None or self._slab_generation != self.host.generation:
            offsets = slab_word_offsets(self.host.k_slabs, self.host.v_slabs)
            self._slab_offsets = torch.tensor(offsets, dtype=torch.int64).to(self.device)
            self._slab_generation = self.host.generation
        return self._slab_offsets

    def _allocate_slots(self, size: int) -> int:
        """The first of `size` consecutive ring slots, the next ones round the ring. Starts are multiples of `size`:
        a pipeline of groups of one size then cycles through disjoint slots even after a load of another size."""
        first = -(-self.next_slot // size) * size
        if first + size > self.num_slots:
            first = 0
        self.next_slot = (first + size) % self.num_slots
        return first

    def _issue_group(self, layer: int, blocks: list[int], size: int,
                     cache_slots: list[int | None] | None = None) -> int:
        """Load `blocks` into consecutive ring slots: from the host, or device to device for the blocks that
        `cache_slots` places in the GPU block cache (cached_block_groups loaded those first, on the same stream)."""
        first = self._allocate_slots(size)
        s = self.streams
        if s.cuda:
            capture = self.capture
            fork = capture.fork_event(torch.cuda.current_stream(self.device)) if capture is not None else None
            with torch.cuda.stream(s.h2d):
                last = None
                for slot in range(first, first + len(blocks)):  # the attention that last read these slots is done
                    event = s.slot_free[slot] or fork
                    if event is not None and event is not last:
                        s.h2d.wait_event(event)
                        last = event
                if capture is None:
                    s.wait_offloaded(s.h2d, layer)  # the blocks reached the host
                host_blocks = blocks if cache_slots is None else self._copy_cached(first, blocks, cache_slots)
                self._copy_runs(layer, first, host_blocks)
                s.slot_loaded[first].record(s.h2d)
        else:
            host_blocks = blocks if cache_slots is None else self._copy_cached(first, blocks, cache_slots)
            self._copy_runs(layer, first, host_blocks)
        self._count_loads(len(blocks) if cache_slots is None else sum(b is not None for b in host_blocks))
        return first

    def _count_loads(self, blocks: int) -> None:
        stats = self.transfer_stats if self.capture is None else self.capture.moved
        stats["h2d_bytes"] = stats.get("h2d_bytes", 0) + 2 * self.block_bytes * blocks
        stats["h2d_blocks"] = stats.get("h2d_blocks", 0) + blocks

    def _copy_runs(self, layer: int, first_slot: int, blocks: list[int]) -> None:
        """One copy per run of consecutive host blocks in one slab (a sequence's blocks are mostly consecutive);
        None entries (blocks copied from the GPU block cache) are skipped."""
        start = 0
        while start < len(blocks):
            if blocks[start] is None:
                start += 1
                continue
            end = start + 1
            while end < len(blocks) and blocks[end] is not None and self.host.contiguous(blocks[end - 1], blocks[end]):
                end += 1
            host_k, host_v = self.host.blocks(layer, blocks[start], end - start)
            slots = slice(first_slot + start, first_slot + end)
            self.k_slots[slots].copy_(host_k, non_blocking=True)
            self.v_slots[slots].copy_(host_v, non_blocking=True)
            if self.fp8 is not None:
                self.fp8.copy_scales(layer, blocks[start], end - start, first_slot + start)
            start = end

    def wait_slots(self, first: int, count: int) -> None:
        if self.streams.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.streams.slot_loaded[first])

    def get_kv_for_slots(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `count` consecutive slots as one sequence of keys: [count * block_size, KVH, D] each."""
        return self.k_slots[first:first + count].flatten(0, 1), self.v_slots[first:first + count].flatten(0, 1)

    def record_slots_compute_done(self, first: int, count: int) -> None:
        s = self.streams
        if s.cuda:  # one event for the group (a decode step is bound by such host calls)
            event = s.free_pool[s.free_next]
            s.free_next = (s.free_next + 1) % len(s.free_pool)
            event.record(torch.cuda.current_stream(self.device))
            for slot in range(first, first + count):
                s.slot_free[slot] = event

    # ---- prefill buffer: the chunk being written
    def ensure_prefill_capacity(self, num_tokens: int) -> None:
        """Layerwise prefill holds a whole prompt per layer; chunked prefill never grows this."""
        if num_tokens > self.prefill_k.shape[1]:
            self.synchronize()
            shape = (self.prefill_k.shape[0], num_tokens, *self.prefill_k.shape[2:])
            self.prefill_k = torch.empty(shape, dtype=self.prefill_k.dtype, device=self.device)
            self.prefill_v = torch.empty_like(self.prefill_k)

    def write_prefill_buffer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v [N, KVH, D]
        self.wait_prefill_offload(layer)
        n = k.shape[0]
        self.prefill_k[layer, :n].copy_(k)
        self.prefill_v[layer, :n].copy_(v)
        self._mark_written(layer)

    def offload_prefill_buffer_async(self, layer: int, cpu_block: int, n: int, start: int = 0) -> None:
        """Rows [start, start+n) of the layer's prefill buffer become host block `cpu_block` (n <= block_size)."""
        self._offload(layer, cpu_block, self.prefill_k[layer, start:start + n], self.prefill_v[layer, start:start + n])

    def wait_prefill_offload(self, layer: int) -> None:
        if self.streams.cuda and self.capture is None:
            self.streams.wait_offloaded(torch.cuda.current_stream(self.device), layer)

    # ---- decode buffer: each sequence's unfinished block
    def prefill_keys(self, layer: int, start: int, n: int) -> torch.Tensor:
        return self.prefill_k[layer, start:start + n]  # [n, KVH, D]

    def decode_keys(self, row: int, layer: int) -> torch.Tensor:
        return self.decode_k[row, layer]  # [block_size, KVH, D]

    def get_decode_layer_kv(self, row: int, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_k[row, layer, :n], self.decode_v[row, layer, :n]  # [n, KVH, D]

    def decode_slots(self, rows: list[int], offsets: list[int]) -> torch.Tensor:
        """[L, B] int64 on the device: where each sequence's new token goes in the decode buffer, per layer (flat
        index into [max_seqs * L * block_size]); built once per step so that each layer's write is one copy."""
        table = self.decode_slot_table(rows, offsets)
        return torch.tensor(table, dtype=torch.int64, pin_memory=self.streams.cuda).to(
            self.device, non_blocking=True).view(-1, len(rows))

    def decode_slot_table(self, rows: list[int], offsets: list[int]) -> list[int]:
        """decode_slots' [L * B] values, layer-major, on the host."""
        num_layers, bs = self.decode_k.shape[1], self.block_size
        return [(row * num_layers + layer) * bs + offset for layer in range(num_layers)
                for row, offset in zip(rows, offsets)]

    def write_decode_tokens(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots [B] int64 on the device (a row of decode_slots); k, v [B, KVH, D]
        self.wait_prefill_offload(layer)
        k_rows, v_rows = self._decode_kv_rows
        k_rows.index_copy_(0, slots, k)
        v_rows.index_copy_(0, slots, v)  # offload_decode_buffer_async marks the layer written when it needs to

    def copy_prefill_tail_to_decode(self, layer: int, row: int, start: int, n: int) -> None:
        """The partial last block of a finished prefill continues in the sequence's decode buffer."""
        self.decode_k[row, layer, :n].copy_(self.prefill_k[layer, start:start + n])
        self.decode_v[row, layer, :n].copy_(self.prefill_v[layer, start:start + n])

    def offload_decode_buffer_async(self, layer: int, row: int, cpu_block: int) -> None:
        self._mark_written(layer)
        self._offload(layer, cpu_block, self.decode_k[row, layer], self.decode_v[row, layer])

    # ---- shared
    def _mark_written(self, layer: int) -> None:
        if self.streams.cuda:
            self.streams.layer_written[layer].record(torch.cuda.current_stream(self.device))

    def _offload(self, layer: int, cpu_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        host_k, host_v = self.host.block(layer, cpu_block)
        s = self.streams
        copies = [(host_k[:n], k), (host_v[:n], v)]  # (host destination, device source)
        scales = None
        if self.fp8 is not None:
            copies = self.fp8.quantize_for_offload(layer, cpu_block, k, v, s.d2h if s.cuda else None)
            self._mark_written(layer)  # the copies below wait for the quantization too
            k, v, scales = copies[0][1], copies[1][1], (copies[2][1], copies[3][1])  # what the cache stores
        if s.cuda:
            with torch.cuda.stream(s.d2h):
                s.d2h.wait_event(s.layer_written[layer])
                for dst, src in copies:
                    dst.copy_(src, non_blocking=True)
                self._write_through(layer, cpu_block, k, v, scales)
                s.layer_offloaded[layer].record(s.d2h)
            s.offloads[layer] += 1
        else:
            for dst, src in copies:
                dst.copy_(src)
            self._write_through(layer, cpu_block, k, v, scales)
        self.transfer_stats["d2h_bytes"] += 2 * n * self.block_bytes // self.block_size
        self.transfer_stats["d2h_blocks"] += 1

    # ---- captured decode steps (the graph runner drives these through OffloadKVStore)
    def start_capture(self, capture: RingCapture) -> None:
        """Work from now on runs at replay time: forget the events recorded outside the graph."""
        self.capture = capture
        if self.streams.cuda:
            self.streams.slot_free = [None] * self.num_slots

    def finish_capture(self) -> None:
        """Back to eager work: the events recorded during the capture mean nothing outside the graph; later loads
        wait for everything queued on the compute stream so far."""
        self.capture = None
        self.mark_ring_read()

    def offloads_issued(self) -> int:
        return sum(self.streams.offloads) if self.streams.cuda else 0

    def order_after_offloads(self) -> None:
        """Work queued on the compute stream from now on waits for every offload issued so far."""
        if self.streams.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.streams.d2h)

    def mark_ring_read(self) -> None:
        """Work queued so far on the compute stream read every ring slot: later loads into the ring wait for it."""
        s = self.streams
        if s.cuda:
            event = s.free_pool[s.free_next]
            s.free_next = (s.free_next + 1) % len(s.free_pool)
            event.record(torch.cuda.current_stream(self.device))
            s.slot_free = [event] * self.num_slots

    def synchronize(self) -> None:
        if self.streams.cuda:
            self.streams.h2d.synchronize()
            self.streams.d2h.synchronize()
