"""graph.mode=cudagraph with offload=cpu: the whole decode step in one CUDA graph per KV layout.

Once the host blocks each sequence may read are fixed, an offloaded decode step needs nothing from the host:
  loads      host-known block lists are copy-engine memcpys on a branch of the graph, ordered by events recorded
             in the capture (OffloadEngine.begin_capture), so a layer's loads overlap the compute as in eager
             steps; a block-selecting policy (Quest) chooses on the device and its blocks are gathered from
             pinned host memory by a kernel
  new token  its decode-buffer slot and the length of the sequence's unfinished block are read from a static
             device buffer that the host fills before each replay (OffloadKVStore.use_static_decode_inputs)
What does change is the layout (OffloadKVStore.decode_layout): the sequences' decode rows and full host blocks
(one more every block_size tokens) and the host slabs. A step with a new layout runs eagerly, then is captured
(the eager run compiled every kernel and made every device-side id list); later steps with that layout replay
it. A step in which a block fills runs eagerly - its offload calls the policies' hooks and issues D2H copies -
and drops the graphs of older layouts. Per block of decode: two eager steps and one capture, the rest replays.

Each graph has its own memory pool, freed with the graph: at most MAX_GRAPHS layouts are kept (a batch whose
sequences fill blocks at different steps cycles through layouts). Replays are ordered after pending offloads
(their gathers read those host blocks) and later ring loads after the replay (OffloadEngine.before/after_graph_
replay); a replay adds the transfers its capture counted to the engine's transfer_stats.
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
from sparsekv.engine.cuda_graph import DecodeGraphRunner, step_context

log = logging.getLogger(__name__)


class OffloadGraphRunner(DecodeGraphRunner):
    """graph.mode=cudagraph over an OffloadKVStore: one graph of the whole decode step per KV layout."""
    mode = GraphMode.cudagraph
    MAX_GRAPHS = 4

    def __init__(self, model, kv_store, device: torch.device, max_batch_size: int, emulate: bool = False):
        super().__init__(model, kv_store, device, [max_batch_size], emulate)  # resolve_graph_mode vetted the policy
        # layout -> (replay, hidden [B, hidden] it writes, transfer counts it moves)
        self.graphs: OrderedDict[tuple, tuple[Callable[[], None], torch.Tensor, dict[str, int]]] = OrderedDict()
        self.stats.update(layout_captures=0, layout_capture_seconds=0.0)
        self.disabled = False  # a capture failed: every later step runs eagerly

    def can_run(self, seqs) -> bool:
        if self.disabled:
            self.eager_steps += 1
            return False
        return super().can_run(seqs)

    def _allocate(self) -> None:
        self.inputs = torch.zeros(2 * self.max_batch_size, dtype=torch.int64, device=self.device)  # ids, positions
        self.kv_store.use_static_decode_inputs()

    def _capture(self, bs: int) -> None:
        """Nothing up front: a layout is captured when a step first runs it."""

    def _static_buffers(self) -> list[torch.Tensor]:
        return [self.inputs, self.kv_store.static_decode_inputs]

    def prepare_decode(self, batch):
        seqs = batch.seqs
        n = len(seqs)
        host = self._host([seq.token_ids[-1] for seq in seqs] + [len(seq) - 1 for seq in seqs], torch.int64)
        static = self.inputs[:2 * n]
        static.copy_(host, non_blocking=True)
        ids, positions = static.view(2, n)
        return ids, positions, Context(is_prefill=False, kv_store=self.kv_store, seqs=seqs), list(range(n))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        store = self.kv_store
        if store.filled:  # offloads and policy hooks run on the host; the next step has a new layout
            self._drop_graphs()
            self.eager_steps += 1
            return self._forward(input_ids, positions, context)
        layout = store.decode_layout(context.seqs)
        entry = self.graphs.get(layout)
        if entry is None:
            hidden = self._forward(input_ids, positions, context)  # also the warm-up of the capture
            self.eager_steps += 1
            try:
                self._capture_layout(layout, input_ids, positions, context)
            except RuntimeError as error:  # e.g. a policy that syncs with the host while choosing blocks
                self.disabled = True
                log.warning("graph.mode=cudagraph: capturing an offloaded decode step failed (%s); decoding eagerly "
                            "from now on. A policy whose block choice needs the host should set "
                            "decode_graph_safe=False (graph=auto then picks segmented)", error)
            return hidden
        self.graphs.move_to_end(layout)
        replay, hidden, moved = entry
        engine = store.engine
        engine.before_graph_replay()
        if self.emulate:  # the emulated replay re-runs the step's Python: as under capture, counting nothing
            with _captured(engine):
                replay()
        else:
            replay()
        engine.after_graph_replay(moved)
        self.replayed_steps += 1
        return hidden

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        with step_context(context):
            return self.model(ids, positions)  # [B, hidden]

    def _capture_layout(self, layout: tuple, ids: torch.Tensor, positions: torch.Tensor, context: Context) -> None:
        engine = self.kv_store.engine
        start = time.perf_counter()
        with _captured(engine) as moved:  # a private pool per graph: dropping a layout frees its memory
            replay, hidden = self.capturer.capture(functools.partial(self._forward, ids, positions, context),
                                                   warmup=False, private_pool=True)
        self.graphs[layout] = (replay, hidden, moved)
        while len(self.graphs) > self.MAX_GRAPHS:
            self.graphs.popitem(last=False)
        self.stats["layout_captures"] += 1
        self.stats["layout_capture_seconds"] += time.perf_counter() - start

    def _drop_graphs(self) -> None:
        self.graphs.clear()
        self.kv_store.engine.forget_device_ids()  # only the dropped graphs read the old lists


@contextlib.contextmanager
def _captured(engine):
    """The engine in capture mode for the block; yields a dict that is then filled with the transfer counts the
    block recorded, which are taken back out of engine.transfer_stats (a capture moves nothing)."""
    before = dict(engine.transfer_stats)
    moved: dict[str, int] = {}
    engine.begin_capture()
    try:
        yield moved
    finally:
        engine.end_capture()
        moved.update({key: engine.transfer_stats[key] - before[key] for key in before})
        engine.transfer_stats.update(before)
