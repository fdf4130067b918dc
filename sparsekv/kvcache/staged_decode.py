"""One ring pipeline per layer for a whole offloaded decode batch, when the GPU block cache cannot hold the batch.

The batch's attended blocks of a layer (every full block of each sequence, or each sequence's selection) are one
list, sequence after sequence, read through the ring by one reader call: copy engines for a host list (the next
group loads on the copy stream while this one is attended), the gather kernel for device-side selections. With a
GPU block cache, the part of host lists it holds is attended first, in one paged call over the cache
(batched_decode.cached_partial), and only the blocks it could not take go through the ring. Each ring group is a
small paged pool: one paged decode call attends every sequence's blocks inside the group (a sequence with none there
has length 0), and the group's partial merges into the running output by log-sum-exp, starting from the unfinished
blocks' partial (and the cached part's).

Where a sequence's blocks fall among the groups depends only on how many blocks each sequence attends, which the
host knows (a device selection's length is fixed on the host), so every table is one cached device tensor per
content (OffloadEngine.device_block_ids): a captured decode step replays with the tables it was captured with.
"""
from __future__ import annotations

from itertools import accumulate

import torch

from sparsekv.kernels import merge_attention_outputs, paged_decode_attention
from sparsekv.kvcache.batched_decode import cached_partial, tail_attention
from sparsekv.kvcache.reader import RingReader


def staged_decode_attention(reader: RingReader, q: torch.Tensor, scale: float, blocks: list[list[int]],
                            decode_slots: torch.Tensor, tail_lengths: torch.Tensor,
                            selections: list[list[int] | torch.Tensor] | None = None) -> torch.Tensor:
    """q [B, H, D] of the batch's new tokens; blocks: each sequence's full host blocks; decode_slots [B] int64 (the
    layer's row of OffloadKVStore.decode_slots) and tail_lengths [B] on the device; selections: per sequence the
    blocks to attend (host ids as a list or a device tensor), None: all of them -> attention [B, H, D]."""
    engine = reader.engine
    attended = blocks if selections is None else selections
    out, lse = tail_attention(engine, q, scale, decode_slots, tail_lengths)  # [B, H, D], [H, B]
    if engine.cache is not None and not any(isinstance(chosen, torch.Tensor) for chosen in attended):
        attended, held = cached_partial(engine, reader.layer, q, scale, attended)  # the ring reads the rest
        if held is not None:
            out, lse = merge_attention_outputs(out, lse, *held)
    counts = [len(chosen) for chosen in attended]
    if not any(counts):
        return out
    starts = [0, *accumulate(counts)][:-1]  # where each sequence's blocks begin in the flat list
    position = 0
    # host lists: half the ring per group, so one group loads while the other is attended
    # fp8 host tier: groups stay fp8, the paged kernel dequantizes them on load by their scales
    for group, scales in reader.scaled_groups(_flat(engine, attended), group_size=max(1, engine.num_slots // 2),
                                              through_cache=False):
        n = len(group.ids)
        table, lengths, width = _group_table(engine, starts, counts, position, n)
        k = group.k.unflatten(0, (n, engine.block_size))  # [n, block_size, KVH, D]: the group as a paged pool
        v = group.v.unflatten(0, (n, engine.block_size))
        o_group, lse_group = paged_decode_attention(q, k, v, table.view(len(counts), width), lengths, scale,
                                                    max_context_len=width * engine.block_size, scales=scales)
        out, lse = merge_attention_outputs(out, lse, o_group, lse_group)
        position += n
    return out


def _flat(engine, attended: list[list[int] | torch.Tensor]) -> list[int] | torch.Tensor:
    """The batch's attended blocks, sequence after sequence: a host list, or one device tensor when any sequence's
    choice is on the device (host lists joining it go through device_block_ids)."""
    if not any(isinstance(chosen, torch.Tensor) for chosen in attended):
        return [block for chosen in attended for block in chosen]
    parts = [chosen if isinstance(chosen, torch.Tensor) else engine.device_block_ids(list(chosen))
             for chosen in attended if len(chosen)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _group_table(engine, starts: list[int], counts: list[int], position: int, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A ring group holding positions [position, position + n) of the flat list: ([B * W] group-local block
    indices, [B] key counts) on the device and the width W."""
    spans = [(max(start, position), min(start + count, position + n)) for start, count in zip(starts, counts)]
    width = max(1, max(hi - lo for lo, hi in spans))
    table = []
    for lo, hi in spans:
        local = list(range(lo - position, hi - position)) if hi > lo else []
        table += local + [0] * (width - len(local))
    ids = engine.device_block_ids(table + [max(0, hi - lo) * engine.block_size for lo, hi in spans])
    return ids[:len(table)], ids[len(table):], width
