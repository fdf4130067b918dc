"""Rank 0 of a tensor-parallel engine: an LLMEngine whose public calls that change engine state are first sent
to the worker ranks (sparsekv/distributed/worker.py), which run the same calls on their own engines."""
from __future__ import annotations

import contextlib

import torch

from sparsekv.distributed.launch import Ranks
from sparsekv.distributed.state import TensorParallel
from sparsekv.engine.llm_engine import LLMEngine, RequestOutput
from sparsekv.engine.sampler import Sampler
from sparsekv.engine.sequence import Sequence
from sparsekv.sampling_params import SamplingParams


def drop_graphs(engine: LLMEngine) -> None:
    """Release the engine's captured decode graphs (eager decode from here on). Runs before destroy_process_group:
    a graph that captured an NCCL collective keeps the communicator's destruction waiting."""
    engine.runner.graph_runner = None


class TensorParallelSampler(Sampler):
    """Greedy rows agree on every rank (argmax of the same all-gathered logits). A batch with a sampled row takes
    rank 0's tokens: rank 0 samples (its seeded generators), the others receive them."""

    def __init__(self, tp: TensorParallel):
        super().__init__()
        self.tp = tp

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> torch.Tensor:
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)  # [B] int64
        tokens = super().sample(logits, params, seq_ids) if self.tp.rank == 0 else logits.argmax(dim=-1)
        return self.tp.broadcast(tokens, src=0)


class DistributedEngine(LLMEngine):
    """Mirrored calls: generate (one command for the whole batch), add_request, step, abort, drain, reserve.
    Validation runs here first, so a bad request fails on rank 0 before any worker sees it."""
    ranks: Ranks
    engine_id: int

    def attach(self, ranks: Ranks, engine_id: int) -> None:
        self.ranks, self.engine_id = ranks, engine_id
        ranks.engines.add(self)  # its graphs are dropped before the group is destroyed (Ranks.close)
        self._quiet = False
        self._numbers: dict[int, int] = {}  # seq_id -> request number the workers know it by
        self._next_number = 0

    def _send(self, name: str, *args) -> None:
        if self._quiet:
            return
        if self.ranks.engine_id != self.engine_id or self.ranks.closed:
            raise RuntimeError("this tensor-parallel engine's workers now serve an engine built after it (or have "
                               "exited); one tensor-parallel engine is live per process: build it again to use it")
        self.ranks.send(name, *args)

    @contextlib.contextmanager
    def _local(self):
        quiet, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = quiet

    def generate(self, prompts, sampling_params=None, progress=None) -> list[RequestOutput]:
        token_lists, params_list = self.prepare_requests(prompts, sampling_params)
        self._send("generate", token_lists, params_list)
        with self._local():
            return self.run_requests(token_lists, params_list, progress)

    def add_request(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        if not self._quiet:
            self.check_fits(len(token_ids))
            self._next_number += 1
            self._send("add_request", self._next_number, list(token_ids), params)
        seq = super().add_request(token_ids, params)
        if not self._quiet:
            self._numbers[seq.seq_id] = self._next_number
        return seq

    def step(self) -> list[Sequence]:
        self._send("step")
        with self._local():
            return super().step()

    def abort(self, seq: Sequence) -> None:
        self._send("abort", self._numbers.pop(seq.seq_id, None))
        with self._local():
            super().abort(seq)

    def drain(self) -> list[Sequence]:
        self._send("drain")
        with self._local():
            return super().drain()

    def reserve(self, num_tokens: int) -> float:
        self._send("reserve", num_tokens)
        return super().reserve(num_tokens)

    def drop_graphs(self) -> None:
        drop_graphs(self)

    def close(self) -> None:
        """Hand the workers' GPU memory back now (a new engine's build does it too)."""
        if self.ranks.engine_id == self.engine_id and not self.ranks.closed:
            self.ranks.send("release")
