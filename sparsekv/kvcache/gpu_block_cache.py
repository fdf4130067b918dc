"""GpuBlockCache: host blocks kept on the device once loaded, so later steps read them without a host copy.

Keying. An entry is (layer, host block): the K and V of one block of one layer, in one cache slot. The cache is
split into equal per-layer regions (slots_per_layer each), since every layer of a step reads the same blocks for
full attention; within a region a miss takes the slot after the previous block's slot when it can, so a sequence's
blocks end up in runs of consecutive slots that one attention call reads as one group.

Eviction: least recently used by step (the last eager step that used an entry: graph replays do not update it),
within the layer's region. An entry used in the current step (read, loaded
or written through) is never evicted in that step; a miss that finds no free or evictable slot is not cached and
goes through the ring as before (overflow). So a cache smaller than one step's selection keeps what it holds and
streams the rest, and full attention over a context larger than the cache settles on a fixed resident prefix
instead of thrashing.

Write-through: a block offloaded to the host (prefill chunk, filled decode block) is also copied on the device into
its entry when a slot is free or evictable, so re-reads in later prefill chunks and the first decode step hit. An
existing entry of the block is always rewritten, and a block is written before it is read, so an entry never
outlives its host block's content (freed blocks and released host slabs included). A prefill chunk whose prefix the
cache holds in one run of slots is written before its attention instead, into the slots right after the run
(take_run: free ones, or those holding the same blocks), so that the prefix and the chunk are one device view
(CachedLoads.sequence_view); its write-through then copies nothing more.

Staging: a batch's device-side choices (Quest) are read against what the cache holds without the host seeing them
(OffloadEngine.resolve_selected): a chosen block the cache holds is read in place, one it does not is copied from the
host into a staging slot. reserve_staging(layer, n) sets n slots of the layer's region aside for that (taken like a
miss's slot, at most half the region); they hold no host block, are never evicted, and go back with
release_staging() when the store is idle. Such reads update last_used only in eager steps, which look the choices
up on the host afterwards (OffloadEngine._learn) and so move the staged ones into cache slots for the replays that
follow.

Contents: blocks exactly as the host holds them (sparsekv/kvcache/host_quant.py). With the fp8 host tier a slot holds
the block's fp8 K/V and `scales` holds its per-(block, KV head) float32 K and V scales, so a cached block is read by
the same dequantize-on-load kernels as a ring slot, and a GiB holds about twice the blocks of bf16.

Everything here is host-side bookkeeping over the host-known block lists: the engine copies (OffloadEngine).
`epoch` changes whenever a slot gets another block (a miss loaded, an eviction): a captured decode graph bakes in
slot addresses and the copies of the misses it loaded, so graph layouts include it (OffloadKVStore.decode_layout):
a step that loaded misses is followed by a fresh capture whose replays read those blocks as hits, instead of
replays that copy them from the host again every step. Counters: stats (cumulative hits, misses,
overflow, evictions, write-throughs, in blocks).
"""
from __future__ import annotations

import torch

GIB = 1 << 30
FREE, STAGING = -1, -2  # block_in of a slot holding no host block: free, or set aside for staging
PINNED = 1 << 62  # last_used of a staging slot: never the least recently used


class GpuBlockCache:
    def __init__(self, num_layers: int, slots_per_layer: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, scaled: bool = False):
        if slots_per_layer < 1:
            raise ValueError(f"GpuBlockCache needs at least one slot per layer, got {slots_per_layer}")
        self.num_layers, self.slots_per_layer = num_layers, slots_per_layer
        num_slots = num_layers * slots_per_layer
        self.kv = torch.empty((2, num_slots, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.k, self.v = self.kv[0], self.kv[1]  # [num_slots, block_size, KVH, D] each; layer l owns a region
        # fp8 blocks (scaled): their K and V scales [2, num_slots, KVH] float32, beside the slots
        self.scales = torch.zeros((2, num_slots, num_kv_heads), dtype=torch.float32, device=device) if scaled else None
        self.slot_of: list[dict[int, int]] = [{} for _ in range(num_layers)]  # per layer: host block -> slot
        self.block_in = [FREE] * num_slots  # host block held by each slot (FREE, STAGING: none)
        self.last_used = [-1] * num_slots  # step that last used each slot
        self.free: list[list[int]] = [list(range((l + 1) * slots_per_layer - 1, l * slots_per_layer - 1, -1))
                                      for l in range(num_layers)]  # per layer, lowest slot last (popped first)
        self.staging: list[list[int]] = [[] for _ in range(num_layers)]  # per layer: slots set aside for staging
        self._slot_tables: dict[tuple[int, int], list[int]] = {}  # slot_table's lists of the current epoch
        self._tables_epoch = 0
        self.step = 0
        self.epoch = 0
        # lookups count hits, misses and overflow into the dict they are given (the engine's transfer_stats, or a
        # graph capture's, which every replay adds); evictions and write-throughs happen in eager steps only
        self.stats = {"cache_evicted_blocks": 0, "cache_written_blocks": 0}

    @property
    def num_slots(self) -> int:
        return self.num_layers * self.slots_per_layer

    @property
    def bytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.kv.numel() * self.kv.element_size() + scales

    def slot_scales(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V scales [count, KVH] of `count` consecutive slots (None: model-dtype blocks, no scales)."""
        if self.scales is None:
            return None
        return self.scales[0, first:first + count], self.scales[1, first:first + count]

    @staticmethod
    def slots_for(gib: float, num_layers: int, block_bytes: int) -> int:
        """Slots per layer that `gib` GiB hold; block_bytes is K and V of one block of one layer as the host holds
        it (fp8: with its scales)."""
        return int(gib * GIB // (num_layers * block_bytes))

    @property
    def capacity(self) -> int:
        """Host blocks a layer's region can hold now (its slots less those set aside for staging)."""
        return self.slots_per_layer - max(map(len, self.staging))

    def begin_step(self) -> None:
        self.step += 1

    def slot_table(self, layer: int, size: int) -> list[int]:
        """Per host block id below `size` its slot in the layer's region, -1 where the cache does not hold it."""
        if self._tables_epoch != self.epoch:
            self._slot_tables.clear()
            self._tables_epoch = self.epoch
        table = self._slot_tables.get((layer, size))
        if table is None:
            table = [FREE] * size
            for block, slot in self.slot_of[layer].items():
                if block < size:
                    table[block] = slot
            self._slot_tables[(layer, size)] = table
        return table

    def reserve_staging(self, layer: int, n: int) -> list[int] | None:
        """n staging slots of the layer's region (those set aside already, more taken like misses' slots: free
        first, then the least recently used not used this step); None when the region cannot give them (more than
        half of it, or its slots are in use this step)."""
        held = self.staging[layer]
        if n > self.slots_per_layer // 2:
            return None
        if len(held) < n:
            first = layer * self.slots_per_layer
            need = n - len(held)
            free = self.free[layer]
            taken = [free.pop() for _ in range(min(need, len(free)))]
            if len(taken) < need:
                step, block_in, last_used = self.step, self.block_in, self.last_used
                old = sorted((last_used[s], s) for s in range(first, first + self.slots_per_layer)
                             if block_in[s] >= 0 and last_used[s] < step)[:need - len(taken)]
                for _, slot in old:
                    self._evict(layer, slot)
                taken += [slot for _, slot in old]
            for slot in taken:
                self.block_in[slot], self.last_used[slot] = STAGING, PINNED
            held += taken
            self.epoch += 1  # the region changed even where only free slots were taken
            if len(held) < n:
                return None
        return held[:n]

    def release_staging(self) -> None:
        """Every staging slot goes back to its region's free slots."""
        for layer, held in enumerate(self.staging):
            for slot in held:
                self.block_in[slot], self.last_used[slot] = FREE, -1
                self.free[layer].append(slot)
            if held:
                self.epoch += 1
            held.clear()

    def lookup(self, layer: int, blocks: list[int], stats: dict[str, int]
               ) -> tuple[list[int | None], list[tuple[int, int]]]:
        """Per block of `blocks` its cache slot (None: not cached, read it through the ring), and the (block, slot)
        pairs to load from the host before reading. Every block returned with a slot is protected for the step."""
        table, step, last_used = self.slot_of[layer], self.step, self.last_used
        slots: list[int | None] = [table.get(block) for block in blocks]
        hits = 0
        for slot in slots:
            if slot is not None:
                last_used[slot] = step
                hits += 1
        loads = []
        previous = None
        for i, block in enumerate(blocks):
            if slots[i] is None:
                slot = self._take(layer, block, None if previous is None else previous + 1)
                slots[i] = slot
                if slot is not None:
                    loads.append((block, slot))
            previous = slots[i]
        if loads:  # the cache now holds blocks a replay of this step's graph would load again
            self.epoch += 1
        stats["cache_hit_blocks"] = stats.get("cache_hit_blocks", 0) + hits
        stats["cache_miss_blocks"] = stats.get("cache_miss_blocks", 0) + len(loads)
        overflow = len(blocks) - hits - len(loads)
        stats["cache_overflow_blocks"] = stats.get("cache_overflow_blocks", 0) + overflow
        return slots, loads

    def write_slot(self, layer: int, block: int) -> int | None:
        """The slot a block being offloaded is written through to (None: not cached, and any stale entry of it
        dropped)."""
        slot = self.slot_of[layer].get(block)
        if slot is None:
            slot = self._take(layer, block, self.slot_of[layer].get(block - 1, -2) + 1)
        else:
            self.last_used[slot] = self.step
        if slot is not None:
            self.stats["cache_written_blocks"] += 1
        return slot

    def take_run(self, layer: int, blocks: list[int], first: int) -> list[int] | None:
        """The consecutive slots first .. first + len(blocks) - 1 of the layer's region for `blocks`, in order, each
        slot free or holding its block already (an entry of the block in another slot, not used this step, is
        dropped: the block is about to be rewritten), all protected for the step; None, with nothing changed, when
        a slot lies outside the region or holds anything else (another block, staging)."""
        region = range(layer * self.slots_per_layer, (layer + 1) * self.slots_per_layer)
        slots = list(range(first, first + len(blocks)))
        if not blocks or slots[0] not in region or slots[-1] not in region:
            return None
        table, block_in, last_used, step = self.slot_of[layer], self.block_in, self.last_used, self.step
        for block, slot in zip(blocks, slots):
            elsewhere = table.get(block, slot)
            if block_in[slot] not in (FREE, block) or (elsewhere != slot and last_used[elsewhere] >= step):
                return None
        for block, slot in zip(blocks, slots):
            elsewhere = table.get(block, slot)
            if elsewhere != slot:
                block_in[elsewhere], last_used[elsewhere] = FREE, -1
                self.free[layer].append(elsewhere)
            if block_in[slot] == FREE:
                self.free[layer].remove(slot)
                block_in[slot] = block
                table[block] = slot
                self.epoch += 1
            last_used[slot] = step
        return slots

    def _take(self, layer: int, block: int, preferred: int | None) -> int | None:
        """A slot of the layer's region for `block`: `preferred` if free, else a free slot, else the least recently
        used one not used this step; None when every slot is in use this step."""
        first = layer * self.slots_per_layer
        region = range(first, first + self.slots_per_layer)
        step, last_used = self.step, self.last_used
        slot = None
        if preferred is not None and preferred in region and self.block_in[preferred] == FREE:
            slot = preferred
            self.free[layer].remove(slot)
        elif self.free[layer]:
            slot = self.free[layer].pop()
        else:
            oldest = min(region, key=last_used.__getitem__)
            if last_used[oldest] < step:
                slot = oldest
        if slot is None:
            return None
        if self.block_in[slot] >= 0:
            self._evict(layer, slot)
        self.block_in[slot] = block
        self.slot_of[layer][block] = slot
        self.last_used[slot] = step
        return slot

    def _evict(self, layer: int, slot: int) -> None:
        """The slot's host block leaves the cache (the caller gives the slot another use)."""
        del self.slot_of[layer][self.block_in[slot]]
        self.epoch += 1
        self.stats["cache_evicted_blocks"] += 1
