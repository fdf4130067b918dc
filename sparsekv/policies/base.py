"""SparsePolicy: the plugin API for sparse attention.

A policy is a dataclass whose fields are its hyperparameters; its `name` field is what users select with
`policy=<name>`. The base class runs the standard offloaded pipelines once for every policy:

  prefill chunk:  causal attention of the chunk to itself, then each earlier host block that select_blocks
                  keeps is loaded into a GPU ring slot and attended, partials merged by log-sum-exp
  decode step:    each kept host block through the ring, then the sequence's unfinished block from the decode
                  buffer, merged the same way

A selection-only policy (Quest) overrides select_blocks and the metadata hooks; a compute policy (MInference)
overrides compute_chunked_prefill / compute_chunked_decode. Policies never copy KV themselves: every load goes
through the OffloadEngine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from sparsekv.kernels import flash_attn_with_lse, merge_attention_outputs
from sparsekv.kernels.decode_attention import DecodePartials

if TYPE_CHECKING:
    from sparsekv.engine.sequence import Sequence
    from sparsekv.kvcache.offload_engine import OffloadEngine


@dataclass
class PolicyContext:
    query_chunk_idx: int  # prefill: which chunk of the prompt; decode: 0
    num_query_chunks: int
    layer_id: int
    query: torch.Tensor  # [Nq, H, D]
    is_prefill: bool
    block_size: int
    total_kv_len: int  # keys the query may attend to, this chunk/token included
    keys: torch.Tensor | None = None  # prefill: the chunk's own keys [Nq, KVH, D], on the device


@dataclass
class SparsePolicy:
    name: str = "base"
    supports_prefill: ClassVar[bool] = True
    supports_decode: ClassVar[bool] = True
    requires_block_selection: ClassVar[bool] = False
    # graph.mode=cudagraph with offload=cpu captures a decode step once per layout (each sequence's full host
    # blocks) and replays it until a block fills: select_blocks / select_blocks_on_device must then depend only on
    # the candidate list, the layer and device tensors (ctx.query), not on per-token host state such as
    # ctx.total_kv_len. A policy that cannot promise this sets False and decodes with graph=segmented.
    decode_graph_safe: ClassVar[bool] = True

    # ---- optional hooks
    def initialize(self, num_layers: int, num_kv_heads: int, head_dim: int, num_cpu_blocks: int,
                   dtype: torch.dtype, device: torch.device) -> None:
        """Allocate per-layer metadata once the KV layout is known."""

    def on_prefill_offload(self, cpu_block_id: int, layer_id: int, k_cache: torch.Tensor,
                           num_valid_tokens: int) -> None:
        """A prefill block is leaving for the host; its keys k_cache [n, KVH, D] are still on the GPU."""

    def on_decode_offload(self, cpu_block_id: int, layer_id: int, k_cache: torch.Tensor,
                          num_valid_tokens: int) -> None:
        """A filled decode block is leaving for the host; keys still on the GPU. Default: the same as a prefill
        block (override only when decode blocks need different treatment)."""
        self.on_prefill_offload(cpu_block_id, layer_id, k_cache, num_valid_tokens)

    def reset(self) -> None:
        """Forget per-sequence state."""

    # ---- reporting (task=bench, task=quality): how much of the causally visible attention was computed
    def record_density(self, kept, visible) -> None:
        """Note one attention call that computed `kept` of `visible` units (blocks or (query, key) pairs: one
        kind per policy). Either may be a device tensor; nothing syncs until a density is read."""
        self._last_density_counts = (kept, visible)
        total_kept, total_visible = getattr(self, "_density_totals", None) or (0, 0)
        self._density_totals = (total_kept + kept, total_visible + visible)

    def reset_density(self) -> None:
        self._last_density_counts = self._density_totals = None

    @property
    def last_density(self) -> float | None:
        """Computed / visible of the last attention call that recorded one (None before any)."""
        return _ratio(getattr(self, "_last_density_counts", None))

    @property
    def mean_density(self) -> float | None:
        """Computed / visible over every call since construction or reset_density (None before any)."""
        return _ratio(getattr(self, "_density_totals", None))

    # ---- selection
    def select_blocks(self, available_blocks: list[int], offload_engine: "OffloadEngine",
                      ctx: PolicyContext) -> list[int]:
        """Host blocks to load for this query, in order. Default: all of them."""
        return available_blocks

    def select_blocks_on_device(self, available_blocks: list[int], offload_engine: "OffloadEngine",
                                ctx: PolicyContext) -> torch.Tensor | None:
        """Decode: the chosen host block ids as a device tensor [n] int64 (any order), so that they load without a
        host sync (OffloadEngine.gather_block_groups), or None to use select_blocks' list. Default: None."""
        return None

    # ---- computation
    def compute_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                        softmax_scale: float) -> torch.Tensor:
        """offload=none: q [n, H, D] are the last n positions of k/v [S, KVH, D], all on the device -> [n, H, D].
        Default: dense causal attention (the earlier S-n keys fully visible)."""
        n = q.shape[0]
        out, lse = flash_attn_with_lse(q, k[-n:], v[-n:], softmax_scale, causal=True)
        if k.shape[0] > n:
            prefix_out, prefix_lse = flash_attn_with_lse(q, k[:-n], v[:-n], softmax_scale, causal=False)
            out, lse = merge_attention_outputs(prefix_out, prefix_lse, out, lse)
        return out

    def compute_chunked_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                                softmax_scale: float, offload_engine: "OffloadEngine", kvcache_manager,
                                current_chunk_idx: int, seq: "Sequence", num_tokens: int) -> torch.Tensor:
        """q [n, H, D], k/v [n, KVH, D] of this chunk -> [n, H, D]."""
        out, lse = flash_attn_with_lse(q, k, v, softmax_scale, causal=True)
        blocks = kvcache_manager.prefix_blocks(seq)
        if blocks:
            ctx = PolicyContext(current_chunk_idx, kvcache_manager.num_chunks(seq), layer_id, q, True,
                                offload_engine.block_size, seq.num_computed_tokens + num_tokens, keys=k)
            out, lse = self.attend_host_blocks(q, layer_id, softmax_scale, offload_engine,
                                               self.select_blocks(blocks, offload_engine, ctx), out, lse)
        return out

    def compute_chunked_decode(self, q: torch.Tensor, layer_id: int, softmax_scale: float,
                               offload_engine: "OffloadEngine", kvcache_manager, seq: "Sequence") -> torch.Tensor:
        """q [1, H, D] of one sequence's new token -> [1, H, D]."""
        k_tail, v_tail, tail_length = kvcache_manager.decode_tail(seq, layer_id)
        blocks = kvcache_manager.full_blocks(seq)
        chosen = None
        if blocks:
            ctx = PolicyContext(0, 1, layer_id, q, False, offload_engine.block_size, len(seq))
            chosen = self.select_blocks_on_device(blocks, offload_engine, ctx)
            if chosen is None:
                blocks = self.select_blocks(blocks, offload_engine, ctx)
        if chosen is None:
            groups = offload_engine.stream_block_groups(layer_id, blocks)
        else:  # the choice stays on the device: no host sync per layer
            blocks, groups = chosen, offload_engine.gather_block_groups(layer_id, chosen)
        # one split buffer for the tail and every ring group, merged by one reduce (decode is launch-bound)
        partials = DecodePartials(q, softmax_scale, max_sets=1 + offload_engine.num_block_groups(len(blocks)))
        partials.add(k_tail, v_tail, length=tail_length)
        for first, group in groups:
            k_slots, v_slots = offload_engine.get_kv_for_slots(first, len(group))  # [n * block_size, KVH, D]
            partials.add(k_slots, v_slots)
            offload_engine.record_slots_compute_done(first, len(group))
        return partials.finish()[0]

    @staticmethod
    def attend_host_blocks(q: torch.Tensor, layer_id: int, softmax_scale: float, offload_engine: "OffloadEngine",
                           blocks: list[int], out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stream full host blocks through the GPU ring, a group of consecutive slots per attention call, and merge
        each group's attention into (out, lse)."""
        for first, group in offload_engine.stream_block_groups(layer_id, blocks):
            k_slots, v_slots = offload_engine.get_kv_for_slots(first, len(group))  # [n * block_size, KVH, D]
            group_out, group_lse = flash_attn_with_lse(q, k_slots, v_slots, softmax_scale, causal=False)
            offload_engine.record_slots_compute_done(first, len(group))
            out, lse = merge_attention_outputs(group_out, group_lse, out, lse)
        return out, lse


def _ratio(counts) -> float | None:
    if not counts:
        return None
    kept, visible = (float(x) for x in counts)
    return kept / visible if visible else 1.0
