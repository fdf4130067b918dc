"""offload=none: a paged KV cache resident on the device, nano-vllm style block tables."""
from __future__ import annotations

import logging

import torch

from sparsekv.engine.context import Context
from sparsekv.kernels import paged_decode_attention, store_kv
from sparsekv.kernels.paged_attention import MIN_SPLIT_TOKENS, choose_num_splits
from sparsekv.kvcache.base import KVStore, join_rows
from sparsekv.kvcache.paged_selection import PagedSelection
from sparsekv.policies.context import KVLayout, check_attention_output

log = logging.getLogger(__name__)


class PagedKVStore(KVStore):
    """Prefill attention is the prefill policy's compute_prefill over the sequence's keys so far; decode is dense
    paged attention, or, with a block-selecting decode policy, attention over the blocks it selects
    (sparsekv.kvcache.paged_selection)."""
    overlapped_decode_safe = True  # every write and read of a block is a kernel on the compute stream

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, prefill_policy, max_model_len: int | None = None,
                 decode_policy=None, check_selections: bool = False, prefill_token_budget: int | None = None):
        self.block_size = block_size
        self.prefill_token_budget = prefill_token_budget  # a whole_prompt_prefill policy's step (sizing.py)
        self.num_kv_heads = num_kv_heads
        # With max_model_len, the paged kernel's split plan for decode is fixed by it and by the batch size rounded
        # up to a power of two, not by the step's context lengths: eager steps and CUDA-graph replays (which pad
        # batches to 1, 2, 4, 8, 16, 32, 48, ... and need a plan fixed at capture) then split every sequence's keys
        # at the same positions and give bitwise-equal attention, so graph.mode never changes the tokens.
        self.plan_len = -(-max_model_len // block_size) * block_size if max_model_len else None
        self.num_blocks = num_blocks
        # One block past the num_blocks the block manager hands out: CUDA-graph decode (graph.mode=cudagraph) writes
        # the keys of the padding rows of a batch there; nothing reads it.
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.scratch_slot = num_blocks * block_size
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, blocks + 1, block_size, KVH, D]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * self.k_cache.element_size()
        self.prefill_policy = prefill_policy
        layout = KVLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                          max_blocks=num_blocks, dtype=dtype, device=torch.device(device))
        prefill_policy.initialize(layout)
        self.selection: PagedSelection | None = None
        self.active: set[int] = set()  # sequences seen since the store was last idle
        if decode_policy is not None and decode_policy.requires_block_selection and decode_policy.supports_decode:
            if decode_policy is not prefill_policy:
                decode_policy.initialize(layout)
            self.selection = PagedSelection(decode_policy, block_size, torch.device(device), check_selections)
            # a batch chosen on the device keeps every step stream-ordered kernels (the hooks of end_step too); a
            # choice per sequence may read the device from the host mid-step
            self.overlapped_decode_safe = self.selection.batched

    def kv_write_target(self, layer_id: int, context: Context
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache [blocks + 1, block_size, KVH, D], slot_mapping [N]) of the step: the model may store
        the step's k/v there itself (in its q/k norm + rotary kernel) and then call attend with kv_written=True."""
        if context.slot_mapping is None:
            return None
        return self.k_cache[layer_id], self.v_cache[layer_id], context.slot_mapping

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               context: Context, kv_written: bool = False) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer_id], self.v_cache[layer_id]
        if not kv_written:  # else the caller stored them at kv_write_target's slots
            store_kv(k, v, k_cache, v_cache, context.slot_mapping)
        selection = self.selection
        if context.is_prefill:
            out = self._prefill(layer_id, q, k, v, scale, context)
            if selection is not None:  # the selecting decode policy's hooks see every written block
                self.active.update(seq.seq_id for seq in context.seqs)
                selection.prefill_written(layer_id, k_cache, context)
            return out
        out = selection.attend(layer_id, q, k_cache, v_cache, scale, context) if selection is not None else None
        if out is None:  # dense (every block kept)
            max_len, splits = self.decode_plan(q.shape[0]) or (context.max_context_len, None)
            out, _ = paged_decode_attention(q, k_cache, v_cache, context.block_tables, context.context_lens,
                                            scale, max_context_len=max_len, num_splits=splits,
                                            min_split_tokens=MIN_SPLIT_TOKENS)
        return out

    def end_step(self, context: Context) -> None:
        if self.selection is not None and not context.is_prefill:  # also after a replayed CUDA graph of the step
            self.selection.decode_written(self.k_cache, context)

    def _prefill(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 context: Context) -> torch.Tensor:
        outs, policy = [], self.prefill_policy
        for chunk in context.chunks:
            rows = slice(chunk.start, chunk.end)
            keys, values = k[rows], v[rows]
            if chunk.num_cached:  # the chunk's keys are stored already: read the whole sequence from the cache
                keys, values = self.sequence_kv(layer_id, chunk.block_table, chunk.num_cached + chunk.num_tokens,
                                                chunk.first_block)
            outs.append(check_attention_output(policy, "compute_prefill", layer_id, q[rows],
                                               policy.compute_prefill(q[rows], keys, values, layer_id, scale)))
        return join_rows(outs)

    def release(self, seq) -> None:
        self.active.discard(seq.seq_id)
        if self.selection is not None and not self.active:  # idle: per-sequence policy state can go
            self.selection.forget()
            self.selection.policy.reset()

    def decode_plan(self, batch: int) -> tuple[int, int] | None:
        """(max_context_len, num_splits) for a decode step of `batch` sequences; None without max_model_len."""
        if self.plan_len is None:
            return None
        padded = 1 << max(0, batch - 1).bit_length()  # constant over each CUDA-graph batch bucket
        return self.plan_len, choose_num_splits(padded, self.num_kv_heads, self.plan_len, self.k_cache.device)

    def sequence_kv(self, layer_id: int, block_table: torch.Tensor, num_tokens: int, first_block: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K/V [num_tokens, KVH, D] of the first num_tokens tokens of a sequence: views of the cache when
        its blocks are one ascending run starting at first_block (no copy), else one gather of its blocks."""
        num_blocks = (num_tokens + self.block_size - 1) // self.block_size
        k_cache, v_cache = self.k_cache[layer_id], self.v_cache[layer_id]  # [blocks + 1, block_size, KVH, D]
        if first_block is not None:
            span = slice(first_block, first_block + num_blocks)
            return k_cache[span].flatten(0, 1)[:num_tokens], v_cache[span].flatten(0, 1)[:num_tokens]
        blocks = block_table[:num_blocks].long()
        return (k_cache.index_select(0, blocks).flatten(0, 1)[:num_tokens],
                v_cache.index_select(0, blocks).flatten(0, 1)[:num_tokens])
