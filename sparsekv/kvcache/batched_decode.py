"""One attention call per layer for a whole offloaded decode batch, through the GPU block cache.

When every full block a decode batch may attend sits in the GPU block cache (or is loaded into it: one batch of
host copies per layer), the batch needs no ring and no per-sequence pipeline: each sequence's attended blocks are a
row of cache slot ids, and the paged decode kernel attends all rows at once over the cache (sequences of any
lengths; a sequence with no full block has length 0; with the fp8 host tier the pages are fp8, dequantized on load
by their scales). The unfinished blocks are a second paged call over the decode buffer (block row * L + layer of
each sequence), and the two partials merge by log-sum-exp.

When the cache cannot hold every block of the batch, a selecting policy's choices are resolved against what it
holds (selected_decode_attention): one gather per layer reads each chosen block in place when the cache holds it
and copies it from the host into a staging slot of the cache when it does not (OffloadEngine.resolve_selected), and
the same paged call attends the resulting slot table; the host never sees the choices.

Selections: None per sequence (full attention) builds the slot table on the host. A selecting policy chooses for
the whole batch in one call per layer (SparsePolicy.select_blocks_batch); its device-tensor choices are mapped to
slots on the device through a host block -> slot table, so nothing waits for the host. Every device tensor made
here is one per distinct content (OffloadEngine.device_block_ids), so a captured decode step replays with the tables
it was captured with, and a layout (OffloadKVStore.decode_layout) fixes their content.
"""
from __future__ import annotations

import torch

from sparsekv.kernels import merge_attention_outputs, paged_decode_attention
from sparsekv.kvcache.offload_engine import OffloadEngine


def batched_decode_attention(engine: OffloadEngine, layer: int, q: torch.Tensor, scale: float,
                             blocks: list[list[int]], decode_slots: torch.Tensor, tail_lengths: torch.Tensor,
                             selections: list[list[int] | torch.Tensor] | None = None) -> torch.Tensor:
    """q [B, H, D] of the batch's new tokens; blocks: each sequence's full host blocks; decode_slots [B] int64 (the
    layer's row of OffloadKVStore.decode_slots) and tail_lengths [B] on the device; selections: per sequence the
    blocks to attend (host ids as a list or a device tensor), None: all of them -> attention [B, H, D]."""
    flat = [block for seq_blocks in blocks for block in seq_blocks]
    slots = engine.cache_slots(layer, flat)
    if None in slots:  # OffloadKVStore batches a step only when a layer's region holds all of its blocks
        raise RuntimeError(f"batched offloaded decode: layer {layer}'s GPU block cache could not hold the batch's "
                           f"{len(slots)} blocks")
    if selections is None:
        table, lengths = _host_table(engine, _split(slots, blocks))
    else:
        table, lengths = _device_table(engine, flat, slots, selections)
    return _attend_cache(engine, q, scale, table, lengths, decode_slots, tail_lengths)


def selected_decode_attention(engine: OffloadEngine, layer: int, q: torch.Tensor, scale: float,
                              blocks: list[list[int]], decode_slots: torch.Tensor, tail_lengths: torch.Tensor,
                              selections: list[list[int] | torch.Tensor]) -> torch.Tensor | None:
    """As batched_decode_attention for selections the cache need not hold: each chosen block read in place or
    staged from the host by one gather per layer; None when the layer's cache region cannot stage the batch's
    choices (read them through the ring)."""
    flat, counts = _padded_rows(engine, selections, pad=-1)  # padding: neither copied nor attended
    num_blocks = 1 + max((block for seq_blocks in blocks for block in seq_blocks), default=0)
    table = engine.resolve_selected(layer, flat, num_blocks)  # [B * W] slot ids
    if table is None:
        return None
    lengths = engine.device_block_ids([count * engine.block_size for count in counts])
    return _attend_cache(engine, q, scale, table, lengths, decode_slots, tail_lengths)


def cached_partial(engine: OffloadEngine, layer: int, q: torch.Tensor, scale: float, attended: list[list[int]]
                   ) -> tuple[list[list[int]], tuple[torch.Tensor, torch.Tensor] | None]:
    """The part of host-known block lists the GPU block cache holds (misses loaded where it can take them), attended
    in one paged call: (per sequence the blocks it could not take, to read through the ring; (o [B, H, D],
    lse [H, B]) of the cached part, None when it holds none)."""
    slots = engine.cache_slots(layer, [block for chosen in attended for block in chosen])
    rows = _split(slots, attended)
    rest = [[block for block, slot in zip(chosen, row) if slot is None] for chosen, row in zip(attended, rows)]
    held = [[slot for slot in row if slot is not None] for row in rows]
    if not any(held):
        return rest, None
    return rest, _cache_partial(engine, q, scale, *_host_table(engine, held))


def _attend_cache(engine: OffloadEngine, q: torch.Tensor, scale: float, table: torch.Tensor, lengths: torch.Tensor,
                  decode_slots: torch.Tensor, tail_lengths: torch.Tensor) -> torch.Tensor:
    """Paged attention of every sequence over its row of cache slots ([B * W] slot ids, [B] key counts), merged
    with its unfinished block's -> [B, H, D]."""
    o_cached, lse_cached = _cache_partial(engine, q, scale, table, lengths)
    o_tail, lse_tail = tail_attention(engine, q, scale, decode_slots, tail_lengths)
    return merge_attention_outputs(o_cached, lse_cached, o_tail, lse_tail)[0]


def _cache_partial(engine: OffloadEngine, q: torch.Tensor, scale: float, table: torch.Tensor, lengths: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention over rows of cache slots ([B * W] slot ids, [B] key counts) -> (o [B, H, D], lse [H, B])."""
    batch = q.shape[0]
    width = table.shape[0] // batch
    cache = engine.cache
    scales = cache.slot_scales(0, cache.num_slots)  # fp8 host tier: the cache's scales, dequantized on load
    return paged_decode_attention(q, cache.k, cache.v, table.view(batch, width), lengths, scale,
                                  max_context_len=width * engine.block_size, scales=scales)


def tail_attention(engine: OffloadEngine, q: torch.Tensor, scale: float, decode_slots: torch.Tensor,
                   tail_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's unfinished block (the decode buffer) in one paged call -> (o [B, H, D], lse [H, B])."""
    bs = engine.block_size
    k_pool, v_pool = engine.decode_pool()
    return paged_decode_attention(q, k_pool, v_pool, (decode_slots // bs).view(q.shape[0], 1), tail_lengths, scale,
                                  max_context_len=bs)


def _split(flat: list, lists: list[list[int]]) -> list[list]:
    """`flat` cut into one row per list of `lists`, as long as that list."""
    rows, start = [], 0
    for chosen in lists:
        rows.append(flat[start:start + len(chosen)])
        start += len(chosen)
    return rows


def _host_table(engine: OffloadEngine, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence a row of cache slots: ([B * W] slot ids padded with 0, [B] key counts) on the device, one copy."""
    width = max(1, max(map(len, rows)))
    table = [slot for row in rows for slot in row + [0] * (width - len(row))]
    ids = engine.device_block_ids(table + [len(row) * engine.block_size for row in rows])
    return ids[:len(table)], ids[len(table):]


def _device_table(engine: OffloadEngine, flat: list[int], slots: list[int],
                  selections: list[list[int] | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected blocks of every sequence: ([B * W] slot ids, [B] key counts) on the device. Each row is the
    selection's host block ids padded with 0, mapped to slots by one lookup into a host block -> slot table."""
    lut = [0] * (max(flat, default=0) + 1)
    for block, slot in zip(flat, slots):
        lut[block] = slot
    chosen, counts = _padded_rows(engine, selections, pad=0)
    ids = engine.device_block_ids(lut + [count * engine.block_size for count in counts])
    return ids[:len(lut)][chosen], ids[len(lut):]


def _padded_rows(engine: OffloadEngine, selections: list[list[int] | torch.Tensor], pad: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """Every sequence's selected host block ids as one row of W (the longest selection) padded with `pad`: [B * W]
    on the device, and each selection's length (a device selection's length is fixed on the host)."""
    counts = [len(selection) for selection in selections]
    width = max(1, max(counts))
    rows = []
    for selection, count in zip(selections, counts):
        rows.append(selection if isinstance(selection, torch.Tensor) else engine.device_block_ids(list(selection)))
        if count < width:
            rows.append(engine.device_block_ids([pad] * (width - count)))
    return torch.cat(rows), counts
