"""offload=none with a block-selecting decode policy: the policy chooses among the sequence's resident blocks.

The paged store calls the policy's metadata hooks when its blocks are written (every block a prefill chunk touches,
with its valid rows, after the prefill layer; the blocks that a decode step fills, after the step: graph replays
included). A policy with paged_device_selection chooses for the whole batch per layer on the device
(sparsekv.kvcache.paged_batch_selection; capturable). Any other is asked per decode step and sequence for a
selection among the sequence's full blocks (the same PolicyContext as offload=cpu, candidates being paged block
ids); each sequence then attends to its selected blocks followed by its unfinished block, through the paged decode
kernel with a per-step block table. A step where every selection is None (all blocks) returns None: the store runs
its dense path unchanged.
"""
from __future__ import annotations

import torch

from sparsekv.engine.context import Context
from sparsekv.kernels import paged_decode_attention
from sparsekv.kvcache.paged_batch_selection import BatchRows, attend_selected_batch, batch_rows
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.context import PolicyContext, check_selection


class PagedSelection:
    def __init__(self, policy: SparsePolicy, block_size: int, device: torch.device, check_selections: bool = False):
        self.policy, self.block_size, self.device = policy, block_size, device
        self.check_selections = check_selections
        # one device-side choice per layer for the batch, or one select_blocks call per sequence
        self.batched = policy.paged_device_selection and policy.decode_graph_safe
        self._ids: dict[tuple[int, ...], torch.Tensor] = {}  # candidate lists -> [n] int64 on the device
        self._step: tuple[Context, BatchRows] | None = None  # the batched path's rows of the step running

    def device_ids(self, blocks) -> torch.Tensor:
        key = tuple(blocks)
        ids = self._ids.get(key)
        if ids is None:
            if len(self._ids) >= 256:
                self._ids.clear()
            ids = self._ids[key] = torch.tensor(key, dtype=torch.int64).to(self.device, non_blocking=True)
        return ids

    def forget(self) -> None:
        self._ids.clear()
        self._step = None

    # ---- metadata hooks
    def prefill_written(self, layer: int, k_cache: torch.Tensor, context: Context) -> None:
        """k_cache [blocks + 1, block_size, KVH, D] of the layer, after the step's keys were stored."""
        bs = self.block_size
        for chunk in context.chunks:
            end = chunk.num_cached + chunk.num_tokens
            for index in range(chunk.num_cached // bs, -(-end // bs)):
                block, n = chunk.seq.block_table[index], min(bs, end - index * bs)
                self.policy.on_prefill_offload(block, layer, k_cache[block, :n], n)

    def decode_written(self, k_cache: torch.Tensor, context: Context) -> None:
        """k_cache [L, blocks + 1, block_size, KVH, D], after a decode step stored every layer's keys."""
        bs = self.block_size
        filled = [seq.block_table[(len(seq) - 1) // bs] for seq in context.seqs if len(seq) % bs == 0]
        for layer in range(k_cache.shape[0]) if filled else ():
            for block in filled:  # the new token filled its block
                self.policy.on_decode_offload(block, layer, k_cache[layer, block], bs)

    # ---- decode
    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               context: Context) -> torch.Tensor | None:
        """q [B, H, D] -> [B, H, D] over each sequence's selected blocks and unfinished block; None when every
        sequence keeps all its blocks."""
        if self.batched:
            if layer == 0 or self._step is None or self._step[0] is not context:  # each forward pass (a graph
                # capture included) derives the rows in its first layer; later layers reuse them
                self._step = (context, batch_rows(context, self.block_size))
            return attend_selected_batch(self.policy, layer, q, k_cache, v_cache, scale, context, self._step[1],
                                         self.check_selections)
        bs, policy = self.block_size, self.policy
        tables, lens, selected = [], [], False
        for b, seq in enumerate(context.seqs):
            n = len(seq)
            full, tail = seq.block_table[:(n - 1) // bs], seq.block_table[(n - 1) // bs]
            selection = None
            if full:
                ctx = PolicyContext(phase="decode", layer=layer, query=q[b:b + 1], candidates=full, block_size=bs,
                                    query_start=n - 1, kv_len=n, softmax_scale=scale, ids_source=self.device_ids)
                selection = check_selection(policy, ctx, policy.select_blocks(ctx), self.check_selections)
            if selection is None:
                tables.append(self.device_ids([*full, tail]))
                kept = len(full)
            elif isinstance(selection, torch.Tensor):
                tables.append(torch.cat([selection.long(), self.device_ids([tail])]))
                kept, selected = selection.shape[0], True
            else:
                tables.append(self.device_ids([*selection, tail]))
                kept, selected = len(selection), True
            lens.append(kept * bs + (n - 1) % bs + 1)
        if not selected:
            return None
        block_tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(torch.int32)  # [B, max blocks]
        context_lens = torch.tensor(lens, dtype=torch.int32).to(self.device, non_blocking=True)  # [B]
        out, _ = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                        max_context_len=max(lens))
        return out
