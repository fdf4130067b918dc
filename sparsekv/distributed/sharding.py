"""Which heads, MLP columns and vocabulary rows a rank holds, and the checks that a model splits over N ranks.

Rank r of N holds query heads [r H/N, (r+1) H/N) and MLP columns [r I/N, (r+1) I/N). KV heads: with KVH >= N,
heads [r KVH/N, (r+1) KVH/N); with KVH < N (N a multiple of KVH), the one KV head its query heads read, head
r KVH // N, replicated on N/KVH ranks. The vocabulary is split in ceil(V/N) rows per rank, the last slice padded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sparsekv.models.spec import ModelSpec


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank holds: `size` indices of dimension `dim` from `start`, of `full`
    (a padded last vocabulary slice holds fewer than `size` real rows)."""
    dim: int
    start: int
    size: int
    full: int

    @property
    def stop(self) -> int:
        return min(self.start + self.size, self.full)

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def read(self, tensor_slice):
        """This rank's part of a safetensors slice (or a tensor): rows or columns [start, stop)."""
        if self.dim == 0:
            return tensor_slice[self.start:self.stop]
        return tensor_slice[:, self.start:self.stop]


@dataclass(frozen=True)
class HeadShards:
    """A rank's attention heads: local counts and first global indices."""
    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int


def head_shards(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShards:
    heads = num_heads // size
    if num_kv_heads >= size:
        kv = num_kv_heads // size
        return HeadShards(heads, kv, rank * heads, rank * kv)
    return HeadShards(heads, 1, rank * heads, rank * num_kv_heads // size)


def vocab_rows(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """ValueError naming parallel.tensor_parallel_size and the fix when the model does not split over `size` ranks."""
    if size == 1:
        return
    key = f"parallel.tensor_parallel_size={size}"
    heads, kv, inter = spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size
    if heads % size:
        raise ValueError(f"{key} does not divide the model's {heads} attention heads; use a divisor of {heads}")
    if kv >= size and kv % size:
        raise ValueError(f"{key} does not divide the model's {kv} KV heads; use a divisor of {kv}")
    if kv < size and size % kv:
        raise ValueError(f"{key} is not a multiple of the model's {kv} KV heads (each KV head is replicated on an "
                         f"equal number of ranks); use a divisor or a multiple of {kv}")
    if inter % size:
        raise ValueError(f"{key} does not divide the model's intermediate_size={inter}; use a divisor of {inter}")


def rank_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The dimensions one rank computes and stores: its attention heads, KV heads and MLP columns (hidden size and
    vocabulary as the model's). The KV store and the per-GPU floors are sized from it."""
    if size == 1:
        return spec
    shards = head_shards(spec.num_attention_heads, spec.num_key_value_heads, 0, size)
    return dataclasses.replace(spec, num_attention_heads=shards.num_heads, num_key_value_heads=shards.num_kv_heads,
                               intermediate_size=spec.intermediate_size // size)
