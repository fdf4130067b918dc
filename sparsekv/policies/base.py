"""SparsePolicy: the plugin API for sparse attention (the boundary types live in sparsekv.policies.context).

A policy is a dataclass whose fields are its hyperparameters; its `name` field is what users select with
`policy=<name>`. The base class runs the standard offloaded pipelines once for every policy, through the
KVReader the store hands it:

  prefill chunk:  causal attention of the chunk to itself, then the selected earlier host blocks, group by group
                  through the GPU ring, partials merged by log-sum-exp
  decode step:    the sequence's unfinished block (reader.tail) and each selected group of host blocks, merged by
                  one reduce (DecodePartials)

A selection policy overrides select_blocks (or score_blocks on ScorerPolicy) and the metadata hooks; a compute
policy (MInference) overrides compute_chunked_prefill / compute_chunked_decode and reads KV through the reader.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsekv.kernels import flash_attn_with_lse, merge_attention_outputs
from sparsekv.kernels.decode_attention import DecodePartials
from sparsekv.kernels.fp8_attention import flash_attn_fp8_with_lse
from sparsekv.policies.context import (KVLayout, KVReader, PagedChoice, PagedDecodeContext, PolicyContext,
                                       PolicySelectionError, Selection, check_selection)


@dataclass
class SparsePolicy:
    name: str = "base"
    supports_prefill: ClassVar[bool] = True
    supports_decode: ClassVar[bool] = True
    requires_block_selection: ClassVar[bool] = False
    # graph.mode=cudagraph with offload=cpu captures a decode step once per layout (each sequence's full host
    # blocks) and replays it until a block fills: select_blocks must then depend only on ctx.candidates,
    # ctx.layer and device tensors (ctx.query, ctx.candidate_ids), not on per-token host state such as ctx.kv_len.
    # A policy that cannot promise this sets False and decodes with graph=segmented.
    decode_graph_safe: ClassVar[bool] = True
    # offload=none: a block-selecting policy that can choose for a whole decode batch on the device, from the
    # resident block tables (select_blocks_paged), sets True. Its decode steps then select once per layer for the
    # batch, without host syncs, and are captured whole by graph.mode=cudagraph (needs decode_graph_safe too).
    # Without it, offload=none selects per sequence (select_blocks) with eager attention (graph.mode=segmented).
    paged_device_selection: ClassVar[bool] = False
    # An empty selection means "only the chunk's own keys / the unfinished block"; without this flag it is an error.
    allow_empty_selection: ClassVar[bool] = False
    # offload=none: a prefill policy that estimates its pattern from the last queries it is given sets True (a class
    # or a dataclass field); the engine then prefills each prompt in one step (the scheduler's prefill budget raised
    # to max_model_len, activation memory sized for it), so the estimate comes from the prompt's end, as the method
    # was published. offload=cpu keeps offload.prefill_chunk_size chunks: the GPU memory stays fixed.
    whole_prompt_prefill: ClassVar[bool] = False

    # ---- metadata hooks, called by the store while the keys are still on the GPU
    def initialize(self, layout: KVLayout) -> None:
        """Allocate per-layer metadata once the KV layout is known."""

    def check_layout(self, layout: KVLayout) -> None:
        """Raise ValueError, naming the setting and the fix, for a KV layout this policy cannot run. The engine calls
        it before the weights load, with max_blocks and expected_blocks 0 (not known yet), so bad settings fail
        before any work; initialize() gets the full layout later (default: no check)."""

    def device_bytes_per_block(self, layout: KVLayout) -> int:
        """Device bytes the metadata of one host block takes, all layers (default 0: none). offload=cpu reserves
        this for every block the scheduler's sequences can hold before it gives the rest of the device memory to
        the GPU block cache; a table that grows past what it declared can run the device out of memory."""
        return 0

    def on_prefill_offload(self, block_id: int, layer: int, keys: torch.Tensor, n: int) -> None:
        """A prefill block leaves for the host; keys [n, KVH, D] (its valid rows) are still on the GPU."""

    def on_decode_offload(self, block_id: int, layer: int, keys: torch.Tensor, n: int) -> None:
        """A filled decode block leaves for the host. Default: the same as a prefill block."""
        self.on_prefill_offload(block_id, layer, keys, n)

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
    def select_blocks(self, ctx: PolicyContext) -> Selection:
        """Which of ctx.candidates to attend: None (all), a list of ids, or a device tensor [k] int64 of ids (loaded
        by the gather kernel without a host sync). See sparsekv.policies.context.check_selection for the rules."""
        return None

    def checked_selection(self, ctx: PolicyContext, reader: KVReader) -> list[int] | torch.Tensor:
        """select_blocks, validated, with None resolved to the candidates."""
        selection = check_selection(self, ctx, self.select_blocks(ctx), reader.check_selections)
        return ctx.candidates if selection is None else selection

    def select_blocks_batch(self, ctxs: list[PolicyContext]) -> list[Selection]:
        """select_blocks for one layer's decode contexts of a whole batch (one per sequence, each with candidates):
        one selection per context, in order, by the same rules. Default: select_blocks on each; a policy overrides
        it to choose for every sequence in one device computation."""
        return [self.select_blocks(ctx) for ctx in ctxs]

    def checked_selections(self, ctxs: list[PolicyContext], reader: KVReader) -> list[list[int] | torch.Tensor]:
        """select_blocks_batch, each selection validated as by checked_selection, None resolved to the candidates."""
        selections = self.select_blocks_batch(ctxs)
        if not isinstance(selections, (list, tuple)) or len(selections) != len(ctxs):
            count = len(selections) if isinstance(selections, (list, tuple)) else type(selections).__name__
            raise PolicySelectionError(f"{type(self).__name__}.select_blocks_batch: returned {count} selections "
                                       f"for {len(ctxs)} contexts; return a list with one selection per context")
        checked = (check_selection(self, ctx, selection, reader.check_selections)
                   for ctx, selection in zip(ctxs, selections))
        return [ctx.candidates if selection is None else selection for ctx, selection in zip(ctxs, checked)]

    def select_blocks_paged(self, ctx: PagedDecodeContext) -> PagedChoice | None:
        """offload=none, policies with paged_device_selection: the choice of every row of a decode batch, made on the
        device (no .item(), .tolist() or host branch on device values: the step is captured in a CUDA graph). Row b
        must choose what select_blocks would for its PolicyContext (as a set; None there means every candidate,
        here counts[b] = num_candidates[b]). None: every row attends all its candidates (e.g. a dense layer).
        See sparsekv.policies.context.PagedChoice for the shape rules."""
        raise NotImplementedError(f"{type(self).__name__} sets paged_device_selection but does not implement "
                                  "select_blocks_paged; implement it or leave the flag False")

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

    def compute_chunked_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PolicyContext,
                                reader: KVReader) -> torch.Tensor:
        """offload=cpu: q [n, H, D], k/v [n, KVH, D] of this chunk -> [n, H, D]."""
        out, lse = flash_attn_with_lse(q, k, v, ctx.softmax_scale, causal=True)
        if ctx.candidates:
            for group, scales in reader.scaled_groups(self.checked_selection(ctx, reader)):
                if scales is None:
                    group_out, group_lse = flash_attn_with_lse(q, group.k, group.v, ctx.softmax_scale, causal=False)
                else:  # fp8 host blocks: dequantized by the kernel, on load
                    group_out, group_lse = flash_attn_fp8_with_lse(q, group.k, group.v, scales, ctx.softmax_scale)
                out, lse = merge_attention_outputs(group_out, group_lse, out, lse)
        return out

    def compute_chunked_decode(self, q: torch.Tensor, ctx: PolicyContext, reader: "DecodeReader") -> torch.Tensor:
        """offload=cpu: q [1, H, D] of one sequence's new token -> [1, H, D]."""
        blocks = self.checked_selection(ctx, reader) if ctx.candidates else ctx.candidates
        # one split buffer for the tail and every ring group, merged by one reduce (decode is launch-bound)
        partials = DecodePartials(q, ctx.softmax_scale, max_sets=1 + reader.num_groups(len(blocks)))
        k_tail, v_tail, tail_length = reader.tail
        partials.add(k_tail, v_tail, length=tail_length)
        for group, scales in reader.scaled_groups(blocks):  # fp8 host blocks: dequantized by the kernel, on load
            partials.add(group.k, group.v, scales=scales)
        return partials.finish()[0]


class DecodeReader(KVReader):
    """A decode step's reader also holds the sequence's unfinished block: (k, v [n, KVH, D], length [1] on the
    device or None); see OffloadKVStore.decode_tail."""
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _ratio(counts) -> float | None:
    if not counts:
        return None
    kept, visible = (float(x) for x in counts)
    return kept / visible if visible else 1.0
