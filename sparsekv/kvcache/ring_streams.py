"""The ring engine's CUDA streams and events (Streams) and the graph capture it loads into (RingCapture); see
sparsekv/kvcache/offload_engine.py for how loads, offloads and compute are ordered by them."""
from __future__ import annotations

from typing import Protocol

import torch


class RingCapture(Protocol):
    """A CUDA-graph capture in progress, as the engine sees it (the graph runner owns it: OffloadStepCapture in
    sparsekv/graphs/offload_graph.py)."""
    moved: dict[str, int]  # transfers issued during the capture: they happen at each replay, not now

    def fork_event(self, stream: "torch.cuda.Stream") -> "torch.cuda.Event":
        """An event recorded on the capturing stream at the capture's start: a slot's first load waits for it."""


class Streams:
    """CUDA streams and events; on CPU every copy is synchronous and these are no-ops."""

    def __init__(self, device: torch.device, num_slots: int, num_layers: int):
        self.cuda = device.type == "cuda"
        if not self.cuda:
            return
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.slot_loaded = [torch.cuda.Event() for _ in range(num_slots)]
        # the event after the attention that last read each slot; the slots of one group share one event, taken
        # round-robin from a pool (a re-recorded event only makes a later wait more conservative, never wrong)
        self.slot_free: list[torch.cuda.Event | None] = [None] * num_slots
        self.free_pool = [torch.cuda.Event() for _ in range(2 * num_slots)]
        self.free_next = 0
        self.layer_offloaded = [torch.cuda.Event() for _ in range(num_layers)]
        self.layer_written = [torch.cuda.Event() for _ in range(num_layers)]
        # offloads issued per layer, and the count each stream last waited for: a stream that already waited for
        # the layer's latest offload skips the wait (one CUDA call less per layer and group on the decode path)
        self.offloads = [0] * num_layers
        self.waited: dict[tuple[int, int], int] = {}

    def wait_offloaded(self, stream: torch.cuda.Stream, layer: int) -> None:
        """Make `stream` wait until the layer's offloads so far reached the host."""
        key = (stream.cuda_stream, layer)
        if self.waited.get(key) != self.offloads[layer]:
            stream.wait_event(self.layer_offloaded[layer])
            self.waited[key] = self.offloads[layer]
