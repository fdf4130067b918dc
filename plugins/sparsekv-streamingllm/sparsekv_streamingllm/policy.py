"""StreamingLLM (Xiao et al., 2023): keep the first tokens (attention sinks) and a window of recent ones.

As a sparsekv policy it is pure block selection on ctx.candidates. With offload=cpu the base class's pipelines do
the work:

  prefill chunk  the chunk attends to itself causally, plus the first `sink_blocks` and the last `recent_blocks`
                 host blocks before it
  decode step    the first `sink_blocks` and the last `recent_blocks` full host blocks, plus the unfinished block

so only those blocks cross PCIe. With offload=none (all keys on the device) compute_prefill applies the same rule
per query block of `block_size` tokens: each block attends to the sink tokens and to the `recent_blocks` blocks
before it plus itself (causally); decode selects the same way among the paged blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsekv.kernels import flash_attn_with_lse, merge_attention_outputs
from sparsekv.policies import PolicyContext, SparsePolicy


@dataclass
class StreamingLLMPolicy(SparsePolicy):
    """Attention sinks + recent window, prefill and decode."""
    name: str = "streaming_llm"  # what users select: policy=streaming_llm
    sink_blocks: int = 1  # leading blocks always attended
    recent_blocks: int = 4  # most recent full blocks attended (besides the current chunk / unfinished block)
    block_size: int = 256  # offload=none only: tokens per block (offload=cpu uses the host blocks)

    supports_prefill: ClassVar[bool] = True
    supports_decode: ClassVar[bool] = True
    requires_block_selection: ClassVar[bool] = True
    allow_empty_selection: ClassVar[bool] = True  # sink_blocks=recent_blocks=0: only the newest keys

    def __post_init__(self) -> None:  # bad values fail when the policy is built, naming the field
        for field, minimum in (("sink_blocks", 0), ("recent_blocks", 0), ("block_size", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"policy.{field}={value!r}: must be an integer >= {minimum}")

    # offload=cpu: only the returned host blocks are loaded; None keeps every candidate
    def select_blocks(self, ctx: PolicyContext) -> list[int] | None:
        n = len(ctx.candidates)
        if n <= self.sink_blocks + self.recent_blocks:
            return None
        return [*ctx.candidates[:self.sink_blocks], *ctx.candidates[n - self.recent_blocks:]]

    # offload=none: q [n, H, D] are the last n positions of k/v [S, KVH, D]
    def compute_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                        softmax_scale: float) -> torch.Tensor:
        n, seq, bs = q.shape[0], k.shape[0], self.block_size
        q_start = seq - n
        sink_end = self.sink_blocks * bs
        last_block = -(-seq // bs) - 1
        if last_block - self.recent_blocks <= self.sink_blocks:  # every window reaches the sinks: dense causal
            return super().compute_prefill(q, k, v, layer_id, softmax_scale)
        out = torch.empty_like(q)
        for qb in range(q_start // bs, -(-seq // bs)):  # query blocks, aligned to position 0
            lo, hi = max(q_start, qb * bs), min(seq, (qb + 1) * bs)
            rows = slice(lo - q_start, hi - q_start)
            window = max(0, qb - self.recent_blocks) * bs
            if window <= sink_end:  # sinks and window touch: one causal call over [0, hi)
                o, _ = flash_attn_with_lse(q[rows], k[:hi], v[:hi], softmax_scale, causal=True)
            else:  # window causally (bottom-right aligned), sinks without a mask, merged by log-sum-exp
                o, lse = flash_attn_with_lse(q[rows], k[window:hi], v[window:hi], softmax_scale, causal=True)
                if sink_end:
                    o_sink, lse_sink = flash_attn_with_lse(q[rows], k[:sink_end], v[:sink_end], softmax_scale)
                    o, _ = merge_attention_outputs(o_sink, lse_sink, o, lse)
            out[rows] = o
        return out
