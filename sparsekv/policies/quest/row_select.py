"""Quest's decode choice for rows of (query, candidate blocks) at once: the batched selection of the offloaded store
(candidates padded to the longest row) and of the resident store (each row's full blocks in its block table).

A row keeps its first candidate (attention sink), its newest (the last valid one) and the keep - 2 middle blocks of
largest summed share (sparsekv.policies.quest.quest_score.quest_row_shares): the choice quest_select makes for one
query. Everything stays on the device; rows without keep valid candidates get meaningless ids (callers ignore them).
"""
from __future__ import annotations

import torch

from sparsekv.policies.quest.quest_score import quest_row_shares


def quest_select_rows(query: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, ids: torch.Tensor,
                      num_valid: torch.Tensor, scale: float, keep: int) -> torch.Tensor:
    """query [R, H, D], kmax/kmin [blocks, KVH, D] (one layer's tables), ids [R, N] int64 block ids (row r's
    candidates are its first num_valid[r]; later ids only need to index the tables), num_valid [R] int64,
    2 <= keep <= N -> [R, keep] int64 chosen ids: sink, newest, then the best of the middle."""
    rows, width = ids.shape
    if not 2 <= keep <= width:
        raise ValueError(f"keep={keep} must be at least 2 and at most the {width} candidate columns")
    position = torch.arange(width, device=ids.device)  # [N]
    valid = position[None, :] < num_valid[:, None]  # [R, N]
    safe = ids.clamp(0, kmax.shape[0] - 1)
    scores = quest_row_shares(query, kmax[safe], kmin[safe], scale, valid).sum(dim=1)  # [R, N]
    newest = (num_valid[:, None] - 1).clamp(min=0)  # [R, 1] position of each row's newest block
    middle = valid & (position > 0) & (position[None, :] != newest)
    best = torch.topk(scores.masked_fill(~middle, float("-inf")), keep - 2, dim=1, sorted=False).indices
    return torch.cat([ids[:, :1], ids.gather(1, newest), ids.gather(1, best)], dim=1)
