"""ScorerPolicy: a selection policy written as one score per candidate block.

A subclass implements score_blocks(ctx) -> [n] scores (higher = more needed). The base keeps the first
`sink_blocks` and the last `recent_blocks` candidates and fills the rest of a `token_budget` with the best scores,
entirely on the device (a top-k; no host sync, safe inside a captured decode step). The result is a set of
distinct candidate ids by construction, so a scorer cannot select a bad block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.context import PolicyContext, PolicySelectionError


@dataclass
class ScorerPolicy(SparsePolicy):
    name: str = "scorer"
    token_budget: int = 4096  # tokens of host blocks attended per query, sinks and recent blocks included
    sink_blocks: int = 1  # leading candidates always kept
    recent_blocks: int = 1  # newest candidates always kept

    requires_block_selection = True

    def __post_init__(self) -> None:
        for field, minimum in (("token_budget", 1), ("sink_blocks", 0), ("recent_blocks", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"policy.{field}={value!r}: must be an integer >= {minimum}")

    def score_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        """[len(ctx.candidates)] float on the device: how much the query needs each candidate block."""
        raise NotImplementedError(f"{type(self).__name__} must implement score_blocks(ctx)")

    def budget_blocks(self, block_size: int) -> int:
        """Blocks kept per query, never fewer than the forced sinks and recent blocks."""
        return max(self.token_budget // block_size, self.sink_blocks + self.recent_blocks)

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor | None:
        n = len(ctx.candidates)
        keep = self.budget_blocks(ctx.block_size)
        if n <= keep:
            return None
        scores = self.score_blocks(ctx)
        if scores.shape != (n,):
            raise PolicySelectionError(f"{type(self).__name__}.score_blocks (layer {ctx.layer}, {ctx.phase}): returned "
                                       f"shape {tuple(scores.shape)}, expected ({n},): one score per candidate")
        return top_blocks(ctx.candidate_ids, scores, keep, self.sink_blocks, self.recent_blocks)


def top_blocks(ids: torch.Tensor, scores: torch.Tensor, keep: int, sinks: int, recent: int) -> torch.Tensor:
    """ids [n] int64, scores [n] -> [keep] ids (any order): the first `sinks`, the last `recent`, then the best."""
    n = ids.shape[0]
    forced = torch.cat([ids[:sinks], ids[n - recent:]]) if recent else ids[:sinks]
    if keep == forced.shape[0]:
        return forced
    middle = torch.topk(scores[sinks:n - recent].float(), keep - forced.shape[0], sorted=False).indices + sinks
    return torch.cat([forced, ids[middle]])
