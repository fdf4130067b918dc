"""One attention call per layer for a whole offloaded decode batch, through the GPU block cache.

When every full block a decode batch attends sits in the GPU block cache (or is loaded into it: one batch of
host copies per layer), the batch needs no ring and no per-sequence pipeline: each sequence's cached blocks are a
row of slot ids, and the paged decode kernel attends all rows at once over the cache (sequences of any lengths; a
sequence with no full block has length 0). The unfinished blocks are a second paged call over the decode buffer
(block row * L + layer of each sequence), and the two partials merge by log-sum-exp. The slot table is one device
tensor per distinct content (OffloadEngine.device_block_ids), so a captured decode step replays with the table it
was captured with, and a layout (OffloadKVStore.decode_layout) fixes its content.
"""
from __future__ import annotations

import torch

from sparsekv.kernels import merge_attention_outputs, paged_decode_attention
from sparsekv.kvcache.offload_engine import OffloadEngine


def batched_decode_attention(engine: OffloadEngine, layer: int, q: torch.Tensor, scale: float,
                             blocks: list[list[int]], decode_slots: torch.Tensor,
                             tail_lengths: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] of the batch's new tokens; blocks: each sequence's full host blocks; decode_slots [B] int64 (the
    layer's row of OffloadKVStore.decode_slots) and tail_lengths [B] on the device -> attention [B, H, D]."""
    batch, bs = len(blocks), engine.block_size
    slots = engine.cache_slots(layer, [block for seq_blocks in blocks for block in seq_blocks])
    if None in slots:  # OffloadKVStore batches a step only when a layer's region holds all of its blocks
        raise RuntimeError(f"batched offloaded decode: layer {layer}'s GPU block cache could not hold the batch's "
                           f"{len(slots)} blocks")
    width = max(1, max(map(len, blocks)))
    table, start = [], 0
    for seq_blocks in blocks:
        table += slots[start:start + len(seq_blocks)] + [0] * (width - len(seq_blocks))
        start += len(seq_blocks)
    ids = engine.device_block_ids(table + [len(seq_blocks) * bs for seq_blocks in blocks])
    cache = engine.cache
    o_cached, lse_cached = paged_decode_attention(
        q, cache.k, cache.v, ids[:batch * width].view(batch, width), ids[batch * width:], scale,
        max_context_len=width * bs)  # [B, H, D], [H, B]
    k_pool, v_pool = engine.decode_pool()
    o_tail, lse_tail = paged_decode_attention(
        q, k_pool, v_pool, (decode_slots // bs).view(batch, 1), tail_lengths, scale, max_context_len=bs)
    return merge_attention_outputs(o_cached, lse_cached, o_tail, lse_tail)[0]
