"""CUDA graphs for decode steps (`graph.mode`). Prefill always runs eagerly.

cudagraph (offload=none): the whole decode forward - embedding, every layer with its paged attention, final
norm - is one graph per batch size of a ladder (1, 2, 4, 8, then steps of 16 up to the largest decode batch).
A step copies its inputs into static buffers (input ids, positions, slot mapping, context lengths, block tables
of a fixed width: the blocks of a max_model_len sequence) and replays the graph of the smallest size that
holds the batch. Padding rows write their keys to the KV store's scratch slot and attend to nothing
(context length 0). The paged decode kernel's split plan depends on `max_context_len`, so the graph passes the
constant width * block_size: no host sync and the same kernels at every replay.

cudagraph (offload=cpu): the whole decode step, host KV loads included, one graph per KV layout, in
sparsekv/graphs/offload_graph.py.

segmented (offload=cpu): per-layer graphs around eager attention, in sparsekv/graphs/segmented_graph.py.

All graphs share one memory pool. They are captured lazily: a batch size's graph when a decode step of that size
is first due. LLMEngine.generate captures, before its timing starts, every size its requests can reach (the batch
shrinks as sequences finish), and the engine's warm-up captures batch size 1; a step outside generate() whose size
has no graph yet captures it on the spot (can_run). `engine.graph_stats` records the mode, the sizes captured so
far, and their capture time and memory. `emulate=True` (CPU tests) "replays" by
calling the captured function again on the same static buffers, which exercises all the plumbing without CUDA.

Which mode a run uses and which batch sizes may be captured: sparsekv/graphs/graph_config.py.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import time
from typing import Any, Callable

import torch

from sparsekv.config import GraphMode, OffloadMode
from sparsekv.engine import context as context_module
from sparsekv.engine.context import Context
from sparsekv.graphs.graph_config import as_enum, capture_batch_sizes, graph_settings

log = logging.getLogger(__name__)


# ---- capture
def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


@contextlib.contextmanager
def step_context(context: Context):
    previous = context_module._CONTEXT
    context_module.set_context(context)
    try:
        yield
    finally:
        context_module.set_context(previous)


class _Capturer:
    """Captures callables into CUDA graphs that share one memory pool. Each callable is run once eagerly first
    (Triton compiles, cuBLAS picks its kernels), then captured on a side stream. With `emulate`, replay calls the
    callable again and copies its results into the tensors the first call returned, as a graph would write them."""

    def __init__(self, device: torch.device, emulate: bool):
        self.device, self.emulate = device, emulate
        self.pool = None
        self.graphs: list = []
        self.stream = None if emulate else torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], Any], warmup: bool = True, pool=None) -> tuple[Callable[[], None], Any]:
        """(replay, outputs) of `fn` captured. warmup=False: the caller just ran `fn` eagerly (kernels compiled),
        and the outputs are None when emulated (a capture computes nothing; fn should write static buffers).
        `pool` (new_pool()): the graph allocates there and lives as long as the caller keeps the replay; else it
        shares this capturer's pool and lives as long as the capturer."""
        out = fn() if warmup else None
        if self.emulate:
            if pool is None:
                self.graphs.append(fn)
            return functools.partial(self._emulated_replay, fn, out), out
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        # capture_begin/end rather than `with torch.cuda.graph(...)`, which runs gc.collect() and empty_cache()
        # at every capture: hundreds of segmented captures would take many seconds.
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=pool if pool is not None else self.pool)
            try:
                out = fn()
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        if pool is not None:
            return graph.replay, out
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs.append(graph)
        return graph.replay, out

    def new_pool(self):
        """A memory pool of its own for capture(..., pool=): graphs captured into it are freed together."""
        return object() if self.emulate else torch.cuda.graph_pool_handle()

    @staticmethod
    def _emulated_replay(fn, out) -> None:
        result = fn()
        if out is not None:
            _copy_into(out, result)


class DecodeGraphRunner:
    """What the model runner sees: can_run(seqs), prepare_decode(batch) (None: use the runner's own), and
    forward(input_ids, positions, context) -> hidden [N, hidden] of the real rows."""
    mode: GraphMode

    def __init__(self, model, kv_store, device: torch.device, batch_sizes: list[int], emulate: bool = False):
        if not emulate and device.type != "cuda":
            raise ValueError(f"graph.mode={self.mode.value} needs a CUDA device; this engine runs on {device}")
        self.model, self.kv_store, self.device = model, kv_store, device
        self.batch_sizes = list(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        self.capturer = _Capturer(device, emulate)
        self.emulate = emulate
        self.replayed_steps = 0  # decode steps replayed from graphs
        self.eager_steps = 0  # decode steps too large for the captured sizes, run eagerly
        self.captured: set[int] = set()  # batch sizes whose graphs exist
        self.allocated = False
        self.stats: dict[str, Any] = {"mode": self.mode.value}

    def bucket(self, n: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]

    def can_run(self, seqs) -> bool:
        ok = 0 < len(seqs) <= self.max_batch_size
        if not ok:
            self.eager_steps += 1
        else:
            self.ensure_bucket(len(seqs))
        return ok

    def ensure_bucket(self, n: int) -> None:
        """The graph of a step of n sequences, captured now if it has none (a step outside generate(): its capture
        is timed with it). Before the step writes its static inputs."""
        if self.bucket(n) not in self.captured:
            self.capture_up_to(n, only_bucket=True)

    def prepare_decode(self, batch):
        return None

    def capture(self) -> dict[str, Any]:
        """Allocate the static buffers; the graphs themselves are captured by capture_up_to when first due."""
        with torch.inference_mode():
            self._allocate()
        self.allocated = True
        self.stats.update(capture_seconds=0.0, graph_pool_bytes=0, num_graphs=0, batch_sizes=[],
                          capturable_batch_sizes=list(self.batch_sizes), static_buffer_bytes=self._buffer_bytes())
        return self.stats

    def capture_up_to(self, num_seqs: int, only_bucket: bool = False) -> list[int]:
        """Capture the graphs of every batch size a decode batch of at most num_seqs sequences can use (only the
        bucket of num_seqs itself with only_bucket) that has none yet; returns the sizes captured now. Runs before
        any decode step of those sizes: a capture's warm-up writes the static inputs."""
        if not self.allocated or num_seqs < 1:
            return []
        top = self.bucket(min(num_seqs, self.max_batch_size))
        wanted = [top] if only_bucket else [b for b in self.batch_sizes if b <= top]
        missing = [b for b in wanted if b not in self.captured]
        if not missing:
            return []
        cuda = self.device.type == "cuda" and not self.emulate
        if cuda:
            torch.cuda.synchronize(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            for bs in reversed(missing):  # largest first: the smaller ones fit in its pool
                self._capture(bs)
                self.captured.add(bs)
        if cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.stats.update(
            capture_seconds=self.stats.get("capture_seconds", 0.0) + seconds,
            graph_pool_bytes=self.stats.get("graph_pool_bytes", 0) + (
                torch.cuda.memory_reserved(self.device) - reserved if cuda else 0),
            static_buffer_bytes=self._buffer_bytes(),
            num_graphs=len(self.capturer.graphs),
            batch_sizes=sorted(self.captured),
        )
        log.info("graph.mode=%s: captured graphs for decode batch sizes %s in %.2f s (%d graphs, %.1f MiB in all)",
                 self.mode.value, sorted(missing), seconds, self.stats["num_graphs"],
                 self.stats["graph_pool_bytes"] / 2**20)
        return sorted(missing)

    def _buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._static_buffers())

    def _allocate(self) -> None:
        raise NotImplementedError

    def _capture(self, bs: int) -> None:
        raise NotImplementedError

    def _static_buffers(self) -> list[torch.Tensor]:
        return []

    def _host(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")


class CudaGraphRunner(DecodeGraphRunner):
    """graph.mode=cudagraph: one graph of the whole decode forward per batch size (offload=none)."""
    mode = GraphMode.cudagraph

    def __init__(self, model, kv_store, device: torch.device, batch_sizes: list[int], max_model_len: int,
                 emulate: bool = False):
        super().__init__(model, kv_store, device, batch_sizes, emulate)
        self.scratch_slot = kv_store.scratch_slot
        if self.scratch_slot is None:
            raise ValueError(f"graph.mode=cudagraph needs the device-resident paged KV cache (offload=none); "
                             f"{type(kv_store).__name__} has no scratch slot for padded batch rows: use "
                             "graph=segmented")
        self.block_size = kv_store.block_size
        self.width = -(-max_model_len // self.block_size)  # block-table width: a max_model_len sequence
        self.max_context_len = self.width * self.block_size  # the paged kernel's split plan: fixed per graph
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def _allocate(self) -> None:
        mb, dev = self.max_batch_size, self.device
        # [3 * bs] per batch size: input ids, positions, slot mapping (one copy per step); padding rows: token 0,
        # position 0, the scratch slot, context length 0
        self.inputs = torch.zeros(3 * mb, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(mb, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(mb, self.width, dtype=torch.int32, device=dev)

    def _static_buffers(self) -> list[torch.Tensor]:
        return [self.inputs, self.context_lens, self.block_tables, *(out for _, out in self.graphs.values())]

    def _views(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, positions, slots = self.inputs[:3 * bs].view(3, bs)
        return ids, positions, slots

    def _context(self, bs: int, seqs) -> Context:
        _, _, slots = self._views(bs)
        return Context(is_prefill=False, kv_store=self.kv_store, seqs=seqs, slot_mapping=slots,
                       block_tables=self.block_tables[:bs], context_lens=self.context_lens[:bs],
                       max_context_len=self.max_context_len)

    def _capture(self, bs: int) -> None:
        ids, positions, slots = self._views(bs)
        # a later capture's views overlap the inputs of earlier steps (ids, positions, slots of another batch
        # size): token 0 at position 0, written only to the scratch slot
        ids.zero_(), positions.zero_()
        slots.fill_(self.scratch_slot)
        self.context_lens[:bs].zero_()
        context = self._context(bs, [])
        self.graphs[bs] = self.capturer.capture(functools.partial(self._forward, ids, positions, context))

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        with step_context(context):
            return self.model(ids, positions)  # [bs, hidden]

    def can_run(self, seqs) -> bool:
        if seqs and len(seqs) <= self.max_batch_size and any(len(s.block_table) > self.width for s in seqs):
            self.eager_steps += 1
            return False
        return super().can_run(seqs)

    def prepare_decode(self, batch):
        seqs, bsz = batch.seqs, self.block_size
        n = len(seqs)
        self.ensure_bucket(n)
        bs = self.bucket(n)
        pad = bs - n
        positions = [len(seq) - 1 for seq in seqs]
        ids = [seq.token_ids[-1] for seq in seqs]
        slots = [seq.block_table[p // bsz] * bsz + p % bsz for seq, p in zip(seqs, positions)]
        lens = [len(seq) for seq in seqs] + [0] * pad
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        host = self._host(ids + [0] * pad + positions + [0] * pad + slots + [self.scratch_slot] * pad, torch.int64)
        self.inputs[:3 * bs].copy_(host, non_blocking=True)
        self.context_lens[:bs].copy_(self._host(lens, torch.int32), non_blocking=True)
        # entries past a row's own blocks keep stale values: the kernel reads only tokens < its context length
        self.block_tables[:n, :width].copy_(self._host(tables, torch.int32), non_blocking=True)
        ids_t, positions_t, _ = self._views(bs)
        return ids_t[:n], positions_t[:n], self._context(bs, seqs), list(range(n))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        n = input_ids.shape[0]
        replay, hidden = self.graphs[self.bucket(n)]
        replay()
        self.replayed_steps += 1
        return hidden[:n]


# ---- wiring
def attach_graph_runner(engine, mode, graph_cfg=None, *, emulate: bool = False) -> dict[str, Any]:
    """Give `engine` (its KV pools exist, no decode has run yet) a graph runner whose static buffers are allocated;
    its graphs are captured when first due (DecodeGraphRunner.capture_up_to). engine.graph_stats = {mode,
    batch_sizes (captured so far), capture_seconds, graph_pool_bytes, ...} stays current. `mode` is resolved (see
    resolve_graph_mode); `emulate` replays by re-running the captured functions (CPU tests)."""
    mode = as_enum(mode, GraphMode)
    if mode == GraphMode.auto:
        raise ValueError("attach_graph_runner takes a resolved graph mode; call resolve_graph_mode first")
    stats: dict[str, Any] = {"mode": mode.value, "capture_seconds": 0.0, "graph_pool_bytes": 0,
                             "static_buffer_bytes": 0, "num_graphs": 0, "batch_sizes": [], "capturable_batch_sizes": []}
    engine.runner.graph_runner = None
    if mode != GraphMode.eager:
        _, max_batch, sizes = graph_settings(graph_cfg)
        max_num_seqs = int(engine.config.scheduler.max_num_seqs)
        sizes = capture_batch_sizes(min(max_batch or max_num_seqs, max_num_seqs), sizes)
        if mode == GraphMode.cudagraph and as_enum(engine.config.offload.mode, OffloadMode) == OffloadMode.cpu:
            from sparsekv.graphs.offload_graph import OffloadGraphRunner  # imports this module

            runner = OffloadGraphRunner(engine.model, engine.kv_store, engine.device, sizes[-1], emulate)
        elif mode == GraphMode.cudagraph:
            runner = CudaGraphRunner(engine.model, engine.kv_store, engine.device, sizes, engine.max_model_len,
                                     emulate)
        else:
            from sparsekv.graphs.segmented_graph import SegmentedGraphRunner  # imports this module

            runner = SegmentedGraphRunner(engine.model, engine.kv_store, engine.device, sizes, emulate)
        runner.stats = stats = {**stats, **runner.stats}  # one live dict: later (per-layout) captures update it
        runner.capture()
        engine.runner.graph_runner = runner
    engine.graph_stats = stats
    return stats
