"""The exchange buffers of the fused decode all-reduce (sparsekv.kernels.allreduce_norm), one per rank, each mapped
into every rank's address space by torch's symmetric memory (peer-to-peer over NVLink; multicast stays off).

Opened once per process group, on CUDA only. Every rank opens or none does: a rank that cannot (no peer access
between two of the GPUs, a torch build without symmetric memory) makes every rank keep NCCL's all-reduce, and
rank 0 logs why.
"""
from __future__ import annotations

import logging
import os

import torch

from sparsekv.kernels.allreduce_norm import MAX_ROWS, MAX_WORLD, PeerBuffers, buffer_bytes

log = logging.getLogger(__name__)


def _unavailable(size: int, local_rank: int) -> str | None:
    """Why this rank cannot open the buffers, or None."""
    if size > MAX_WORLD:
        return f"{size} ranks (the fused all-reduce serves at most {MAX_WORLD})"
    for peer in range(min(size, torch.cuda.device_count())):  # one host: the ranks' GPUs are 0 .. size - 1
        if peer != local_rank and not torch.cuda.can_device_access_peer(local_rank, peer):
            return f"GPU {local_rank} has no peer access to GPU {peer}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"this torch build has no symmetric memory ({exc})"
    return None


def open_peer_buffers(rank: int, size: int, local_rank: int, group) -> PeerBuffers | None:
    """Collective over `group` (NCCL, every rank calls it): this rank's PeerBuffers, or None on every rank when any
    rank cannot open them."""
    import torch.distributed as dist

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # only peer-to-peer loads and stores are used
    device = torch.device("cuda", local_rank)
    reason = _unavailable(size, local_rank)
    if not _all_agree(reason is None, device, group):
        if rank == 0:
            log.info("tensor parallelism: decode all-reduces stay on NCCL (%s)", reason or "a worker rank cannot "
                     "open the peer buffers")
        return None
    from torch.distributed import _symmetric_memory as symm_mem

    buffer = symm_mem.empty(buffer_bytes(size) // 4, dtype=torch.int32, device=device)
    buffer.zero_()  # flags at 0, as the counters
    handle = symm_mem.rendezvous(buffer, group.group_name)
    pointers = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    peers = PeerBuffers(pointers, torch.zeros(MAX_ROWS, dtype=torch.int32, device=device), rank, size, buffer)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every rank's flags are zero before any kernel raises one
    return peers


def _all_agree(ok: bool, device: torch.device, group) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
