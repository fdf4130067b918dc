"""offload=none, a policy with paged_device_selection (Quest): one selection per layer for the whole decode batch,
made on the device from the step's block tables, so the step needs nothing from the host and is captured whole in
a CUDA graph (graph.mode=cudagraph; sparsekv/graphs/cuda_graph.py).

Row b's candidates are its full blocks, block_tables[b, :(len - 1) // block_size]; its unfinished block,
block_tables[b, (len - 1) // block_size], is always attended after the chosen ones. Padding rows of a captured
batch (context length 0) have no candidates and attend nothing. The paged kernel's plan is fixed by the policy's
static width C of the choice, (C + 1) * block_size keys, and by the batch rounded up to a power of two, as the dense
path plans from max_model_len: eager steps and graph replays split alike and give the same bits.
"""
from __future__ import annotations

import torch

from sparsekv.engine.context import Context
from sparsekv.kernels import paged_decode_attention
from sparsekv.kernels.paged_attention import MIN_SPLIT_TOKENS, choose_num_splits
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.context import PagedDecodeContext, check_paged_choice


def attend_selected_batch(policy: SparsePolicy, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, scale: float, context: Context,
                          check_selections: bool = False) -> torch.Tensor | None:
    """q [B, H, D], k_cache/v_cache [blocks + 1, block_size, KVH, D] -> [B, H, D] over each row's chosen blocks and
    its unfinished block; None when the policy keeps every block (the store's dense path runs)."""
    block_size = k_cache.shape[1]
    tables = context.block_tables  # [B, W] int32
    lens = context.context_lens.long()  # [B]
    full = torch.div(lens - 1, block_size, rounding_mode="floor").clamp(min=0)  # [B] full blocks, 0 for padding
    ctx = PagedDecodeContext(layer=layer, query=q, candidates=tables, num_candidates=full, block_size=block_size,
                             softmax_scale=scale)
    choice = check_paged_choice(policy, ctx, policy.select_blocks_paged(ctx), check_selections)
    if choice is None:
        return None
    blocks, counts = choice.blocks.long(), choice.counts.long()  # [B, C], [B]
    tail = tables.gather(1, full[:, None]).long()  # [B, 1]
    table = torch.cat([blocks, torch.zeros_like(tail)], dim=1).scatter_(1, counts[:, None], tail)  # [B, C + 1]
    tail_len = torch.where(lens > 0, (lens - 1) % block_size + 1, 0)  # [B]
    step_lens = (counts * block_size + tail_len).to(torch.int32)  # [B]
    max_len = table.shape[1] * block_size
    padded = 1 << max(0, q.shape[0] - 1).bit_length()  # constant over each CUDA-graph batch bucket
    splits = choose_num_splits(padded, k_cache.shape[2], max_len, k_cache.device)
    out, _ = paged_decode_attention(q, k_cache, v_cache, table.to(torch.int32), step_lens, scale,
                                    max_context_len=max_len, num_splits=splits, min_split_tokens=MIN_SPLIT_TOKENS)
    return out
