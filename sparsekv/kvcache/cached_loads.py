"""CachedLoads: the GPU block cache's side of the OffloadEngine (sparsekv/kvcache/gpu_block_cache.py holds the
cache's bookkeeping). Host blocks of a layer are looked up in the cache, misses are copied from the host into
their cache slots, runs of consecutive cache slots are read in place, blocks the cache cannot take go through the
ring, and offloaded blocks are written through (a prefill chunk after a prefix the cache holds in one run: before
its attention, into the slots after the run, so that prefix and chunk are one view: sequence_view). With the fp8
host tier every copy carries the blocks' scales too (host -> cache, cache -> ring, write-through) and groups come
with their scales. Mixed into OffloadEngine, whose streams, ring and host pool it uses."""
from __future__ import annotations

from collections import deque
from typing import Iterator

import torch

from sparsekv.kernels.block_gather import gather_missing_blocks

Scales = tuple[torch.Tensor, torch.Tensor]  # K and V scales [n, KVH] float32 of fp8 blocks


class CachedLoads:
    def cache_slots(self, layer: int, cpu_blocks: list[int]) -> list[int | None]:
        """The GPU block cache slot of each block (None: not cached), misses loaded from the host; the compute
        stream waits for those loads and the layer's write-throughs before it reads the cache."""
        stats = self.transfer_stats if self.capture is None else self.capture.moved
        slots, loads = self.cache.lookup(layer, cpu_blocks, stats)
        if loads:
            self._load_cache(layer, loads)
        elif self.streams.cuda and self.capture is None:
            self.streams.wait_offloaded(torch.cuda.current_stream(self.device), layer)
        return slots

    def resolve_selected(self, layer: int, block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor | None:
        """Cache slots [n] int64 on the device of the host blocks in `block_ids` [n] (ids below num_blocks; others
        are padding), without the host seeing the ids: blocks the cache holds are read in place, the rest copied
        from the host into staging slots of the layer's region (GpuBlockCache.reserve_staging), hits and misses
        counted on the device (collect_device_counts). None when the region cannot stage n blocks: read them
        through the ring."""
        staging = self.cache.reserve_staging(layer, len(block_ids))
        if staging is None:
            return None
        if self.streams.cuda and self.capture is None:  # the host blocks and the layer's write-throughs landed
            self.streams.wait_offloaded(torch.cuda.current_stream(self.device), layer)
        lut = self.device_block_ids(self.cache.slot_table(layer, num_blocks))
        stage = self.device_block_ids(staging)
        table = torch.empty(len(block_ids), dtype=torch.int64, device=self.device)
        gather_missing_blocks(self.cache.kv, (self.host.k_slabs, self.host.v_slabs), self._device_slab_offsets(),
                              block_ids, lut, stage, layer, table, self.device_counts)
        if self.fp8 is not None:
            self.fp8.gather_missing_scales(layer, block_ids, lut, stage, into=self.cache.scales)
        if self.capture is None:
            self._learn(layer, block_ids, table, num_blocks)
        return table

    def _learn(self, layer: int, block_ids: torch.Tensor, table: torch.Tensor, num_blocks: int) -> None:
        """An eager step (one not captured: the step before a capture, or every step without graphs) shows the
        host its choices and their slots (a sync) and looks the choices up like a host list: the cached ones count
        as used, the missing ones move from their staging slots into cache slots (device to device, evicting only
        blocks this step did not choose), so the replays after the capture read them in place. Hits and misses
        (the bytes that crossed PCIe) were counted on the device already."""
        chosen, slots = torch.stack((block_ids, table)).tolist()  # one sync
        staged = {block: slot for block, slot in zip(chosen, slots) if 0 <= block < num_blocks}
        _, loads = self.cache.lookup(layer, list(staged), {})
        if not loads:
            return
        cache = self.cache
        into = torch.tensor([slot for _, slot in loads], device=self.device)
        staging = torch.tensor([staged[block] for block, _ in loads], device=self.device)
        cache.kv[:, into] = cache.kv[:, staging]  # [2, n, block_size, KVH, D]
        if cache.scales is not None:
            cache.scales[:, into] = cache.scales[:, staging]  # [2, n, KVH]
        self.device_block_ids(cache.slot_table(layer, num_blocks))  # the table the capture will read

    def collect_device_counts(self) -> None:
        """Add what resolve_selected counted on the device to transfer_stats (a host sync; not for the hot path):
        hits, and misses as blocks and bytes copied from the host."""
        if self.device_counts is None:
            return
        hits, misses = self.device_counts.tolist()
        if not hits and not misses:
            return
        with torch.inference_mode():  # made and counted into in inference mode
            self.device_counts.zero_()
        stats = self.transfer_stats
        stats["cache_hit_blocks"] += hits
        stats["cache_miss_blocks"] += misses
        stats["h2d_blocks"] += misses
        stats["h2d_bytes"] += 2 * self.block_bytes * misses

    def cached_run(self, layer: int, cpu_blocks: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor, Scales | None, int] | None:
        """The longest leading run of `cpu_blocks` the GPU block cache already holds in consecutive slots, in this
        order, read in place: (k, v [m * block_size, KVH, D], their scales or None, m), its hits counted and protected
        for the step and the compute stream ordered after the layer's write-throughs; None when the cache does not
        hold the first block (nothing looked up, loaded or counted)."""
        first, m = self._leading_run(layer, cpu_blocks)
        if first is None:
            return None
        self.cache_slots(layer, cpu_blocks[:m])
        k, v, scales, _, _ = self._group_view(cpu_blocks[:m], first, None)
        return k, v, scales, m

    def _leading_run(self, layer: int, cpu_blocks: list[int]) -> tuple[int | None, int]:
        """(first slot, m): the longest leading run of `cpu_blocks` the GPU block cache holds in consecutive slots,
        in this order, looked up without counting; (None, 0) when it does not hold the first block."""
        table = self.cache.slot_of[layer] if self.cache is not None else {}
        first = table.get(cpu_blocks[0]) if cpu_blocks else None
        if first is None:
            return None, 0
        m = 1
        while m < len(cpu_blocks) and table.get(cpu_blocks[m]) == first + m:
            m += 1
        return first, m

    def sequence_view(self, layer: int, prefix_blocks: list[int], chunk_blocks: list[int], k: torch.Tensor,
                      v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Prefill: the prefix and the chunk as one device view each, k_all, v_all [kv_len, KVH, D] (kv_len: the
        prefix's full blocks and the chunk's k/v [n, KVH, D] rows), when the GPU block cache holds `prefix_blocks`
        in one run of consecutive slots, in this order, and the slots right after it can take `chunk_blocks`
        (GpuBlockCache.take_run). The chunk's rows are then copied into those slots on the compute stream (its
        write-through, done early: _write_through skips those blocks once) and the prefix's hits are counted and
        protected for the step. The layer's offloads wait for the copy: ring loads copying cache slots run on the
        h2d stream, which is ordered after the offloads, not after the compute stream.
        None, with nothing changed, otherwise (no cache, fp8 blocks in the cache, no prefix, ...)."""
        cache = self.cache
        if (cache is None or self.fp8 is not None or self.capture is not None or not prefix_blocks
                or len(chunk_blocks) != -(-k.shape[0] // self.block_size) or cache.k.dtype != k.dtype):
            return None
        first, m = self._leading_run(layer, prefix_blocks)
        if first is None or m < len(prefix_blocks):
            return None
        start = first + len(prefix_blocks)
        if cache.take_run(layer, chunk_blocks, start) is None:
            return None
        self.cache_slots(layer, prefix_blocks)  # all hits: counted, protected, write-throughs waited for
        end, n = start + len(chunk_blocks), k.shape[0]
        cache.k[start:end].flatten(0, 1)[:n].copy_(k)
        cache.v[start:end].flatten(0, 1)[:n].copy_(v)
        self._mark_written(layer)
        self.written_early.update((layer, block) for block in chunk_blocks)
        cache.stats["cache_written_blocks"] += len(chunk_blocks)
        kv_len = len(prefix_blocks) * self.block_size + n
        return cache.k[first:end].flatten(0, 1)[:kv_len], cache.v[first:end].flatten(0, 1)[:kv_len]

    def cached_block_groups(self, layer: int, cpu_blocks: list[int], group_size: int | None = None
                            ) -> Iterator[tuple[torch.Tensor, torch.Tensor, Scales | None, list[int], int | None]]:
        """Like stream_block_groups through the GPU block cache: yields (k, v [n * block_size, KVH, D], their K and V
        scales [n, KVH] (fp8 host tier, else None), blocks, first ring slot or None) in the order of `cpu_blocks`.
        Without group_size a group is a run of blocks in consecutive cache slots, or up to half the ring of blocks
        the cache could not take; with group_size every group is exactly the next group_size blocks, read in place
        when they sit in consecutive cache slots, else copied into the ring (cached blocks device to device). The
        caller calls record_slots_compute_done for a group with a ring slot after reading it."""
        slots = self.cache_slots(layer, cpu_blocks)
        size = group_size or max(1, self.num_slots // 2)
        groups: list[tuple[list[int], list[int | None]]] = []
        if group_size is not None:
            groups = [(cpu_blocks[i:i + size], slots[i:i + size]) for i in range(0, len(cpu_blocks), size)]
        else:
            start = 0
            while start < len(cpu_blocks):
                end = start + 1
                if slots[start] is None:
                    while end < len(cpu_blocks) and end - start < size and slots[end] is None:
                        end += 1
                else:
                    while end < len(cpu_blocks) and slots[end] == slots[end - 1] + 1:
                        end += 1
                groups.append((cpu_blocks[start:end], slots[start:end]))
                start = end
        in_flight = max(1, self.num_slots // size)
        pending: deque[tuple[list[int], int | None, int | None]] = deque()  # (blocks, cache slot, ring slot)
        ring_pending = 0
        for blocks, group_slots in groups:
            in_place = all(slot is not None for slot in group_slots) and all(
                b == a + 1 for a, b in zip(group_slots, group_slots[1:]))
            if not in_place:
                while ring_pending == in_flight:
                    item = pending.popleft()
                    ring_pending -= item[2] is not None
                    yield self._group_view(*item)
                pending.append((blocks, None, self._issue_group(layer, blocks, size, group_slots)))
                ring_pending += 1
            else:
                pending.append((blocks, group_slots[0], None))
        while pending:
            yield self._group_view(*pending.popleft())

    def _group_view(self, blocks: list[int], cache_slot: int | None, ring_slot: int | None):
        n = len(blocks)
        if cache_slot is not None:
            return (self.cache.k[cache_slot:cache_slot + n].flatten(0, 1),
                    self.cache.v[cache_slot:cache_slot + n].flatten(0, 1), self.cache.slot_scales(cache_slot, n),
                    blocks, None)
        self.wait_slots(ring_slot, n)
        scales = self.fp8.scales_for_slots(ring_slot, n) if self.fp8 is not None else None
        return (*self.get_kv_for_slots(ring_slot, n), scales, blocks, ring_slot)

    def _load_cache(self, layer: int, loads: list[tuple[int, int]]) -> None:
        """Copy host blocks into their cache slots; the compute stream waits for them (and for the layer's
        write-throughs) before anything reads the cache."""
        s = self.streams
        if not s.cuda:
            self._copy_into_cache(layer, loads)
        else:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(s.h2d):  # a reloaded slot was last read before this step began
                capture = self.capture
                s.h2d.wait_event(capture.fork_event(compute) if capture is not None else self._step_start)
                if capture is None:
                    s.wait_offloaded(s.h2d, layer)
                self._copy_into_cache(layer, loads)
            compute.wait_stream(s.h2d)
            if self.capture is None:
                s.wait_offloaded(compute, layer)
        self._count_loads(len(loads))

    def _copy_into_cache(self, layer: int, loads: list[tuple[int, int]]) -> None:
        """One copy per run of host blocks consecutive in one slab and in the cache."""
        k, v = self.cache.k, self.cache.v
        start = 0
        while start < len(loads):
            end = start + 1
            while (end < len(loads) and loads[end][1] == loads[end - 1][1] + 1
                   and self.host.contiguous(loads[end - 1][0], loads[end][0])):
                end += 1
            host_k, host_v = self.host.blocks(layer, loads[start][0], end - start)
            first = loads[start][1]
            k[first:first + end - start].copy_(host_k, non_blocking=True)
            v[first:first + end - start].copy_(host_v, non_blocking=True)
            if self.fp8 is not None:
                self.fp8.copy_scales(layer, loads[start][0], end - start, first, into=self.cache.scales)
            start = end

    def _copy_cached(self, first: int, blocks: list[int], cache_slots: list[int | None]) -> list[int | None]:
        """Copy the cached blocks of a ring group from the cache; returns `blocks` with those replaced by None."""
        for i, slot in enumerate(cache_slots):
            if slot is not None:
                self.k_slots[first + i].copy_(self.cache.k[slot], non_blocking=True)
                self.v_slots[first + i].copy_(self.cache.v[slot], non_blocking=True)
                if self.fp8 is not None:
                    self.fp8.slot_scales[:, first + i].copy_(self.cache.scales[:, slot], non_blocking=True)
        return [None if slot is not None else block for block, slot in zip(blocks, cache_slots)]

    def _write_through(self, layer: int, cpu_block: int, k: torch.Tensor, v: torch.Tensor,
                       scales: Scales | None = None) -> None:
        """An offloaded block's rows k, v [n, KVH, D] as the host stores them (fp8: with their K and V scales [KVH])
        also go to its GPU block cache entry (readers wait for layer_offloaded); a block sequence_view wrote
        already is skipped, once."""
        if self.written_early and (layer, cpu_block) in self.written_early:
            self.written_early.discard((layer, cpu_block))
            return
        slot = self.cache.write_slot(layer, cpu_block) if self.cache is not None else None
        if slot is not None:
            n = k.shape[0]
            self.cache.k[slot, :n].copy_(k, non_blocking=True)
            self.cache.v[slot, :n].copy_(v, non_blocking=True)
            if scales is not None:
                self.cache.scales[0, slot].copy_(scales[0], non_blocking=True)
                self.cache.scales[1, slot].copy_(scales[1], non_blocking=True)

    @property
    def cache_stats(self) -> dict[str, int]:
        """GPU block cache counters in blocks (hits, misses loaded from the host, overflow read through the ring,
        evictions, write-throughs) and its size; empty without a cache."""
        cache = self.cache
        if cache is None:
            return {}
        self.collect_device_counts()
        stats = {key: value for key, value in self.transfer_stats.items() if key.startswith("cache_")}
        stats.update(cache_evicted_blocks=cache.stats["cache_evicted_blocks"],
                     cache_written_blocks=cache.stats["cache_written_blocks"], cache_slots=cache.num_slots,
                     cache_bytes=cache.bytes)
        return stats
