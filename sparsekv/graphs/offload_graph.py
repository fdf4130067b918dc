"""graph.mode=cudagraph with offload=cpu: the whole decode step in one CUDA graph per KV layout.

Once the host blocks each sequence may read are fixed, an offloaded decode step needs nothing from the host:
  loads      host-known block lists are copy-engine memcpys on a branch of the graph, ordered by events recorded
             in the capture (OffloadKVStore.capturing), so a layer's loads overlap the compute as in eager
             steps; a block-selecting policy (Quest) chooses on the device and its blocks are gathered from
             pinned host memory by a kernel
  new token  its decode-buffer slot and the length of the sequence's unfinished block are read from a static
             device buffer the runner owns and the host fills before each replay (bind_static_decode_inputs)
What does change is the layout (OffloadKVStore.decode_layout): the sequences' decode rows and full host blocks
(one more every block_size tokens), the host slabs and the GPU block cache's epoch (a captured step reads cached
blocks at fixed slots: an eviction anywhere changes the layout; a layout is keyed after its capture, when the
eager run has filled the cache). A step with a new layout runs eagerly, then is captured
(the eager run compiled every kernel and made every device-side id list); later steps with that layout replay
it. A step in which a block fills runs eagerly - its offload calls the policies' hooks and issues D2H copies -
and drops the graphs of older layouts. Per block of decode: two eager steps and one capture, the rest replays.

The graphs of a layout have a memory pool of their own, released with them (the caching allocator returns a
dropped pool's memory only on empty_cache, which the step that drops the graphs calls): at most
LayoutGraphs.MAX_LAYOUTS layouts are kept (a batch whose sequences fill blocks at different steps cycles through
layouts), and forgetting the device-side id lists (OffloadKVStore.forget_device_ids) changes every layout, so no
graph reading freed lists ever replays. Replays are ordered after pending offloads (their loads read those host
blocks) and later ring loads after the replay (OffloadKVStore.order_after_offloads / replayed); a replay adds the
transfers its capture counted (OffloadStepCapture.moved) to the store's transfer_stats. LayoutGraphs is shared with
graph.mode=segmented, which captures each whole layer per layout the same way.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import OrderedDict
from typing import Callable

import torch

from sparsekv.config import GraphMode
from sparsekv.engine.context import Context
from sparsekv.graphs.cuda_graph import DecodeGraphRunner, step_context

log = logging.getLogger(__name__)


class LayoutGraphs:
    """Offloaded decode work captured per KV layout, what OffloadGraphRunner (the whole step) and
    SegmentedGraphRunner (each layer) share. plan_step() says how to run a step (and drops the graphs when a block
    fills):
      (None, None)      eagerly, capturing nothing: a block fills (the graphs are dropped), or graphs are off
      (layout, None)    eagerly, then capture(layout, fns) with the step's work as fns
      (layout, entry)   replaying(entry): the entry's graphs, in capture order
    All graphs of a layout share one memory pool, freed with them (replays run in capture order, never at once)."""
    MAX_LAYOUTS = 4

    def __init__(self, kv_store, capturer, stats: dict, emulate: bool, static_inputs: torch.Tensor):
        kv_store.bind_static_decode_inputs(static_inputs)
        self.store, self.capturer, self.stats, self.emulate = kv_store, capturer, stats, emulate
        self.replayed_offloads = 0  # offloads the last replay was ordered after
        # layout -> (replays, transfer counts a replay moves)
        self.graphs: OrderedDict[tuple, tuple[list[Callable[[], None]], dict[str, int]]] = OrderedDict()
        self.disabled = False  # a capture failed: every later step runs eagerly
        stats.update(layout_captures=0, layout_capture_seconds=0.0)

    def plan_step(self, seqs) -> tuple[tuple | None, tuple | None]:
        if self.disabled or not self.store.decode_graph_safe:
            return None, None
        if self.store.block_fills():  # offloads and policy hooks run on the host; the next step has a new layout
            dropped = bool(self.graphs)
            self.graphs.clear()
            if dropped and not self.emulate:
                torch.cuda.empty_cache()  # hand the dropped graphs' pools back: GPU memory must not creep per block
            self.store.forget_device_ids()  # only the dropped graphs read the old lists
            return None, None
        layout = self.store.decode_layout(seqs)
        self._seqs = seqs  # capture() keys the graphs by the layout after the step (the GPU block cache may move)
        entry = self.graphs.get(layout)
        if entry is not None:
            self.graphs.move_to_end(layout)
        return layout, entry

    def capture(self, layout: tuple, fns: list[Callable[[], None]]) -> None:
        """Capture fns (the step just ran them eagerly: kernels compiled, id lists made) as the layout's graphs;
        they leave their results in static buffers."""
        start = time.perf_counter()
        pool = self.capturer.new_pool()
        captured, moved = [], {}
        try:
            for fn in fns:  # each graph orders its loads by events of its own capture
                capture = OffloadStepCapture()
                with self.store.capturing(capture):
                    captured.append(self.capturer.capture(fn, warmup=False, pool=pool))
                moved = {key: moved.get(key, 0) + value for key, value in capture.moved.items()}
        except RuntimeError as error:  # e.g. a policy that syncs with the host while choosing blocks
            self.disabled = True
            log.warning("capturing an offloaded decode step failed (%s); decoding without these graphs from now on. "
                        "A policy whose block choice needs the host should set decode_graph_safe=False", error)
            return
        layout = self.store.decode_layout(self._seqs)  # the eager run and the capture may have filled the cache
        replays = [replay for replay, _ in captured]
        if self.emulate:
            replays = [functools.partial(self._emulated_replay, replay) for replay in replays]
        self.graphs[layout] = (replays, moved)
        while len(self.graphs) > self.MAX_LAYOUTS:
            self.graphs.popitem(last=False)
        self.stats["layout_captures"] += 1
        self.stats["layout_capture_seconds"] += time.perf_counter() - start

    def _emulated_replay(self, replay: Callable[[], None]) -> None:
        """An emulated replay runs the step's Python again, seen by the store as a capture, as a real capture sees
        it: no new device list may be made and the cache learns nothing on the host. Nothing ran in the emulated
        capture (its `moved` is empty), so the replay counts its transfers as it goes."""
        capture = OffloadStepCapture()
        capture.moved = self.store.transfer_stats
        with self.store.capturing(capture):
            replay()

    @contextlib.contextmanager
    def replaying(self, entry: tuple):
        """Yields the entry's replays: ordered after pending offloads, later ring loads ordered after them, and
        their captured transfer counts added to the engine's."""
        replays, moved = entry
        issued = self.store.offloads_issued()
        if issued != self.replayed_offloads:
            self.store.order_after_offloads()
            self.replayed_offloads = issued
        yield replays
        self.store.replayed(moved)


class OffloadGraphRunner(DecodeGraphRunner):
    """graph.mode=cudagraph over an OffloadKVStore: one graph of the whole decode step per KV layout."""
    mode = GraphMode.cudagraph

    def __init__(self, model, kv_store, device: torch.device, max_batch_size: int, emulate: bool = False):
        super().__init__(model, kv_store, device, [max_batch_size], emulate)  # resolve_graph_mode vetted the policy
        self.hidden: torch.Tensor | None = None  # [max_batch, hidden]: where the graphs leave the step's output

    def _allocate(self) -> None:
        self.inputs = torch.zeros(2 * self.max_batch_size, dtype=torch.int64, device=self.device)  # ids, positions
        self.decode_inputs = torch.zeros(self.kv_store.static_decode_inputs_size(), dtype=torch.int64,
                                         device=self.device)  # decode slots and tail lengths (the store fills it)
        self.layouts = LayoutGraphs(self.kv_store, self.capturer, self.stats, self.emulate, self.decode_inputs)

    def capture(self) -> dict:
        stats = super().capture()
        self.captured = set(self.batch_sizes)  # no graph per batch size: a layout is captured when a step first runs it
        stats["batch_sizes"] = list(self.batch_sizes)
        return stats

    def _capture(self, bs: int) -> None:
        """Nothing per batch size (see capture)."""

    def _static_buffers(self) -> list[torch.Tensor]:
        return [self.inputs, self.decode_inputs]

    def prepare_decode(self, batch):
        seqs = batch.seqs
        n = len(seqs)
        host = self._host([seq.token_ids[-1] for seq in seqs] + [len(seq) - 1 for seq in seqs], torch.int64)
        static = self.inputs[:2 * n]
        static.copy_(host, non_blocking=True)
        ids, positions = static.view(2, n)
        return ids, positions, Context(is_prefill=False, kv_store=self.kv_store, seqs=seqs), list(range(n))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        layout, entry = self.layouts.plan_step(context.seqs)
        n = input_ids.shape[0]
        if entry is None:
            hidden = self._forward(input_ids, positions, context)  # also the warm-up of a capture
            self.eager_steps += 1
            if layout is not None:
                if self.hidden is None:
                    self.hidden = hidden.new_empty(self.max_batch_size, hidden.shape[1])
                self.layouts.capture(layout, [functools.partial(self._forward, input_ids, positions, context,
                                                                self.hidden[:n])])
            return hidden
        with self.layouts.replaying(entry) as replays:
            replays[0]()
        self.replayed_steps += 1
        return self.hidden[:n]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, context: Context,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        with step_context(context):
            hidden = self.model(ids, positions)  # [B, hidden]
        return hidden if out is None else out.copy_(hidden)


class OffloadStepCapture:
    """One capture of offloaded decode work (sparsekv.kvcache.offload_engine.RingCapture): the fork event the ring's
    first loads wait for, and the transfers the capture issued (they happen at every replay)."""

    def __init__(self):
        self.moved: dict[str, int] = {}
        self._fork: torch.cuda.Event | None = None

    def fork_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        if self._fork is None:  # the copy stream joins the capture here
            self._fork = torch.cuda.Event()
            self._fork.record(stream)
        return self._fork
