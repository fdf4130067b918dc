"""offload=none, a policy with paged_device_selection (Quest): one selection per layer for the whole decode batch,
made on the device from the step's block tables, so the step needs nothing from the host and is captured whole in
a CUDA graph (graph.mode=cudagraph; sparsekv/graphs/cuda_graph.py).

Row b's candidates are its full blocks, block_tables[b, :(len - 1) // block_size]; its unfinished block,
block_tables[b, (len - 1) // block_size], is always attended after the chosen ones. Padding rows of a captured
batch (context length 0) have no candidates and attend nothing. The paged kernel's plan is fixed by the policy's
static width C of the choice, (C + 1) * block_size keys, and by the batch rounded up to a power of two, as the dense
path plans from max_model_len: eager steps and graph replays split alike and give the same bits. What the rows
give every layer (candidate counts, unfinished blocks) is computed once per step (batch_rows).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sparsekv.engine.context import Context
from sparsekv.kernels import paged_decode_attention
from sparsekv.kernels.paged_attention import MIN_SPLIT_TOKENS, choose_num_splits
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.context import PagedDecodeContext, check_paged_choice


class BatchRows(NamedTuple):
    """What a decode step's rows give every layer's selection (computed once per step)."""
    full: torch.Tensor  # [B] int64 full blocks per row: its candidates (0 for a padding row)
    tail: torch.Tensor  # [B, 1] the unfinished block's id (the block tables' dtype)
    tail_len: torch.Tensor  # [B] int64 keys in the unfinished block (0 for a padding row)


def batch_rows(context: Context, block_size: int) -> BatchRows:
    lens = context.context_lens.long()  # [B]
    full = torch.div(lens - 1, block_size, rounding_mode="floor").clamp(min=0)
    tail_len = torch.where(lens > 0, lens - full * block_size, 0)
    return BatchRows(full, context.block_tables.gather(1, full[:, None]), tail_len)


def attend_selected_batch(policy: SparsePolicy, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, scale: float, context: Context, rows: BatchRows,
                          check_selections: bool = False) -> torch.Tensor | None:
    """q [B, H, D], k_cache/v_cache [blocks + 1, block_size, KVH, D] -> [B, H, D] over each row's chosen blocks and
    its unfinished block; None when the policy keeps every block (the store's dense path runs). `rows`: batch_rows
    of the step."""
    block_size = k_cache.shape[1]
    ctx = PagedDecodeContext(layer=layer, query=q, candidates=context.block_tables, num_candidates=rows.full,
                             block_size=block_size, softmax_scale=scale)
    choice = check_paged_choice(policy, ctx, policy.select_blocks_paged(ctx), check_selections)
    if choice is None:
        return None
    counts = choice.counts.long()  # [B]
    table = torch.cat([choice.blocks.to(rows.tail.dtype), rows.tail], dim=1)  # [B, C + 1]
    table.scatter_(1, counts[:, None], rows.tail)  # the unfinished block right after each row's chosen ones
    step_lens = (counts * block_size + rows.tail_len).to(torch.int32)  # [B]
    max_len = table.shape[1] * block_size
    padded = 1 << max(0, q.shape[0] - 1).bit_length()  # constant over each CUDA-graph batch bucket
    splits = choose_num_splits(padded, k_cache.shape[2], max_len, k_cache.device)
    out, _ = paged_decode_attention(q, k_cache, v_cache, table.to(torch.int32), step_lens, scale,
                                    max_context_len=max_len, num_splits=splits, min_split_tokens=MIN_SPLIT_TOKENS)
    return out
