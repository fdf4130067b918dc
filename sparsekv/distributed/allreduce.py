"""The model's all-reduce: one implementation per process group, resolved once when the group is made
(launch.init_group) and kept in the rank's TensorParallel; the row-parallel linears and the vocabulary-parallel
embedding call it through TensorParallel.all_reduce.

The implementation is the process group's all_reduce (NCCL on CUDA, gloo on CPU). tools/bench_allreduce.py measures
it beside torch's symmetric-memory one-shot / two-shot all-reduce at decode sizes inside captured graphs; a measured
winner replaces the body of resolve_all_reduce for CUDA groups (no runtime choice between implementations is kept).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def resolve_all_reduce(group: Any, device_type: str) -> AllReduce:
    """The sum over `group`'s ranks, in place on x, returning x (stream-ordered on CUDA: no host wait; capturable
    in a CUDA graph)."""
    del device_type  # one implementation on every device for now
    return process_group_all_reduce(group)


def process_group_all_reduce(group: Any) -> AllReduce:
    import torch.distributed as dist

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x
    return all_reduce
