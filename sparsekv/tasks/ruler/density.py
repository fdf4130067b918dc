"""The density of one (task, length) cell of task=ruler: the share of the causally visible attention the policy
computed, and where the figure comes from.

  measured  the policy's own record_density counts since the cell began (policy.mean_density), in its own unit
  dense     full attention computes everything: 1
  budget    a budgeted block selection that records no counts (sparsekv.tasks.common.BudgetedSelection): kept /
            visible full blocks summed over the cell's decode steps and layers, from its budget, dense layers and
            threshold, i.e. what it selects by construction (its prefill is dense and not counted)
  None      none of these
"""
from __future__ import annotations

from typing import Iterable

from sparsekv.tasks.common import BudgetedSelection


def budget_density(policy: BudgetedSelection, block_size: int, num_layers: int,
                   sequences: Iterable[tuple[int, int]]) -> float | None:
    """sequences: (prompt tokens, generated tokens) per sample. The first token comes from the prefill; decode step
    j (1-based) runs with prompt + j tokens, the full blocks before the newest token being its candidates."""
    budget = policy.budget_blocks(block_size)
    dense = min(policy.dense_layers, num_layers)
    kept = visible = 0
    for prompt, generated in sequences:
        for step in range(1, generated):
            blocks = (prompt + step - 1) // block_size
            chosen = blocks if blocks <= policy.threshold_blocks else min(budget, blocks)
            kept += dense * blocks + (num_layers - dense) * chosen
            visible += num_layers * blocks
    return kept / visible if visible else None


def cell_density(policy, block_size: int, num_layers: int,
                 sequences: list[tuple[int, int]]) -> tuple[float | None, str | None]:
    """(density, source) of a cell, after its generation; policy.reset_density() ran before it."""
    from sparsekv.policies.full import FullAttentionPolicy

    measured = policy.mean_density
    if measured is not None:
        return float(measured), "measured"
    if isinstance(policy, FullAttentionPolicy):
        return 1.0, "dense"
    if isinstance(policy, BudgetedSelection):
        density = budget_density(policy, block_size, num_layers, sequences)
        return density, ("budget" if density is not None else None)
    return None, None
