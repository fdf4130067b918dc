"""RingReader: the KVReader a policy gets, host blocks of one layer read through the OffloadEngine's GPU ring (and
its GPU block cache, when there is one)."""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from sparsekv.kvcache.cached_loads import Scales
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.policies.context import KVGroup


class RingReader:
    """groups() yields KVGroups in the order of `blocks`; each is loaded (copy engines for a host list, the gather
    kernel for a device tensor) and waited for before it is yielded, the next one loads meanwhile, and its slots are
    released for reloading when the caller advances (or stops). With fp8 host blocks (offload.host_dtype)
    scaled_groups() yields the fp8 slots and their scales, for kernels that dequantize on load (the base policy's
    prefill and decode); groups() yields them dequantized to the model dtype into a ring-sized scratch, one launch
    per group, for readers that compute on K/V themselves (MInference's prefill). With a GPU block cache, a host
    list's cached blocks are read in place (fp8 host tier: fp8 with their scales, like ring slots) and its groups may
    be shorter than group_size (runs of consecutive cache slots); an explicit group_size still gives exactly
    group_size blocks per group, and resident() gives the longest leading run of a list that the cache holds as one
    group."""
    __slots__ = ("engine", "layer", "tail", "check_selections")

    def __init__(self, engine: OffloadEngine, layer: int, tail=None, check_selections: bool = False):
        self.engine, self.layer, self.tail, self.check_selections = engine, layer, tail, check_selections

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def ring_capacity(self) -> int:
        return self.engine.num_slots

    def num_groups(self, num_blocks: int, group_size: int | None = None) -> int:
        """At most this many groups for `num_blocks` blocks (exact without a cache)."""
        if self.engine.cache is not None and group_size is None:
            return num_blocks  # cache runs are at least one block each
        return self.engine.num_block_groups(num_blocks, group_size)

    def groups(self, blocks: Sequence[int] | torch.Tensor, group_size: int | None = None) -> Iterator[KVGroup]:
        with contextlib.closing(self._groups(blocks, group_size, scaled=False)) as loaded:
            for group, _ in loaded:
                yield group

    def scaled_groups(self, blocks: Sequence[int] | torch.Tensor, group_size: int | None = None,
                      through_cache: bool = True) -> Iterator[tuple[KVGroup, Scales | None]]:
        """Like groups(), each group with its scales: fp8 host blocks come as fp8 K/V with their [n, KVH] K and V
        scales, model-dtype ones with None. through_cache=False: a host list goes straight from the host into the
        ring (the caller read what the GPU block cache holds already)."""
        return self._groups(blocks, group_size, scaled=True, through_cache=through_cache)

    def resident(self, blocks: Sequence[int]) -> KVGroup | None:
        """The longest leading run of `blocks` the GPU block cache holds in consecutive slots, in this order, as one
        group read in place (fp8 host tier: dequantized into new tensors), valid for the whole step; None when the
        cache does not hold the first block. Nothing is loaded: read the rest with groups()."""
        engine = self.engine
        run = engine.cached_run(self.layer, list(blocks)) if engine.cache is not None else None
        if run is None:
            return None
        k, v, scales, m = run
        if scales is not None:
            k, v = engine.fp8.dequantized(k, v, scales)
        return KVGroup(list(blocks[:m]), k, v)

    def _groups(self, blocks, group_size: int | None, scaled: bool,
                through_cache: bool = True) -> Iterator[tuple[KVGroup, Scales | None]]:
        engine = self.engine
        if group_size is not None and not 1 <= group_size <= engine.num_slots:
            raise ValueError(f"group_size={group_size}: must be between 1 and the ring's {engine.num_slots} slots")
        if engine.cache is not None and through_cache and not isinstance(blocks, torch.Tensor):
            for k, v, scales, ids, first in engine.cached_block_groups(self.layer, list(blocks), group_size):
                if scales is not None and not scaled:  # fp8: dequantized for readers that want the model dtype
                    k, v = (engine.fp8.dequantized_slots(engine.k_slots, engine.v_slots, first, len(ids))
                            if first is not None else engine.fp8.dequantized(k, v, scales))
                    scales = None
                try:
                    yield KVGroup(ids, k, v), scales  # k, v [n * block_size, KVH, D]: cache slots or ring slots
                finally:
                    if first is not None:  # ring slots: later loads wait for the caller's kernels
                        engine.record_slots_compute_done(first, len(ids))
            return
        if isinstance(blocks, torch.Tensor):
            loaded = engine.gather_block_groups(self.layer, blocks)
        else:
            loaded = engine.stream_block_groups(self.layer, list(blocks), group_size)
        fp8 = engine.fp8
        for first, ids in loaded:
            count = len(ids)
            if fp8 is None:
                k, v = engine.get_kv_for_slots(first, count)  # [n * block_size, KVH, D] each
                scales = None
            elif scaled:
                k, v = engine.get_kv_for_slots(first, count)  # fp8
                scales = fp8.scales_for_slots(first, count)
            else:
                k, v = fp8.dequantized_slots(engine.k_slots, engine.v_slots, first, count)
                scales = None
            try:
                yield KVGroup(ids, k, v), scales
            finally:  # the caller's kernels on these slots are enqueued: later loads wait for them
                engine.record_slots_compute_done(first, count)
