"""A rank's place in the tensor-parallel group and the model's collectives (NCCL on CUDA, gloo on CPU).

The model reads the current TensorParallel while it is built (`building`); a layer that needs collectives keeps
it. With size 1 the model is built from the plain layers, so a single-GPU step has no collective and no wrapper.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed process group of the model's collectives; None when size == 1
    local_rank: int = 0  # the CUDA device index of this rank
    control: Any = None  # the gloo group of rank 0's commands (sparsekv/distributed/launch.py)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (stream-ordered on CUDA: no host wait; capturable in a CUDA graph). The
        group's own all_reduce (NCCL on CUDA): inside a graph it measured 7.0 us per decode-size call on two H100s,
        ahead of torch's symmetric-memory all-reduce (docs/decisions.md, tools/bench_allreduce.py)."""
        import torch.distributed as dist

        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every rank -> [..., size * n], rank r's part at [r * n, (r + 1) * n)."""
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather(out, x, group=self.group)  # the ranks' x along dim 0
        parts = out.view(self.size, *x.shape)  # [size, ..., n]
        return parts.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        import torch.distributed as dist

        dist.broadcast(x, src=src, group=self.group)
        return x

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the ranks (sizes that each rank measures, e.g. free memory, must agree: every
        rank schedules the same requests the same way)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
    gather(out, x, group=group)


class BuildAborted(Exception):
    """A worker's engine build stopped where a rank failed (rank 0 raises that rank's error)."""


def all_succeeded(tp: TensorParallel, error: BaseException | None) -> None:
    """A build stage's outcome on every rank, exchanged on the command group (no rank is left waiting in a
    collective of the next stage). Rank 0 raises its own error, else a worker's; a worker raises BuildAborted."""
    import torch.distributed as dist

    outcomes: list[str | None] = [None] * tp.size
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}", group=tp.control)
    failed = [(rank, message) for rank, message in enumerate(outcomes) if message is not None]
    if not failed:
        return
    if tp.rank != 0:
        raise BuildAborted(failed[0][1])
    if error is not None:
        raise error
    rank, message = failed[0]
    raise RuntimeError(f"tensor-parallel rank {rank} failed to build its engine: {message}")


SINGLE = TensorParallel()
_CURRENT: TensorParallel = SINGLE


def get_tp() -> TensorParallel:
    """The TensorParallel of the model being built (SINGLE outside `building`)."""
    return _CURRENT


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[TensorParallel]:
    global _CURRENT
    previous, _CURRENT = _CURRENT, tp
    try:
        yield tp
    finally:
        _CURRENT = previous
