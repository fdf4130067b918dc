"""Quest's decode choice for rows of (query, candidate blocks) at once: the batched selection of the offloaded store
(candidates padded to the longest row) and of the resident store (each row's full blocks in its block table).

A row keeps its first candidate (attention sink), its newest (the last valid one) and the keep - 2 middle blocks of
largest summed share: the choice quest_select makes for one query, made for every row by one launch of its kernel
(quest_score.launch_select: a grid over KV heads, candidate tiles and rows). The reference, and the path where
Triton does not run, is torch: a gather of the candidates' key bounds and quest_row_shares over every row at once,
a top-k and a gather. Neither syncs with the host (a resident decode step captures them in its CUDA graph). Rows
without keep valid candidates get meaningless ids (callers ignore them).
"""
from __future__ import annotations

import torch

from sparsekv.policies.quest.quest_score import launch_select, quest_row_shares, select_kernel_fits

__all__ = ["quest_row_scores", "quest_select_rows", "quest_select_rows_reference"]


def quest_row_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, ids: torch.Tensor,
                     num_valid: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, H, D], kmax/kmin [blocks, KVH, D] (one layer's tables), ids [R, N] int (row r's candidates are its first
    num_valid[r]; the ids after them only index clamped, their scores masked), num_valid [R] int -> [R, N] fp32: each
    middle candidate's share summed over KV heads (0 < position < num_valid - 1), -inf elsewhere (sink, newest,
    padding)."""
    rows, heads, dim = q.shape
    if kmax.dim() != 3 or kmax.shape != kmin.shape or kmax.shape[2] != dim or heads % kmax.shape[1]:
        raise ValueError(f"expected q [R, H, D] and kmax/kmin [blocks, KVH, D] with H a multiple of KVH; got q "
                         f"{tuple(q.shape)}, kmax {tuple(kmax.shape)}, kmin {tuple(kmin.shape)}")
    if ids.dim() != 2 or ids.shape[0] != rows or num_valid.shape != (rows,):
        raise ValueError(f"expected ids [R={rows}, N] and num_valid [R]; got {tuple(ids.shape)}, "
                         f"{tuple(num_valid.shape)}")
    position = torch.arange(ids.shape[1], device=ids.device)[None, :]  # [1, N]
    valid = position < num_valid[:, None]  # [R, N]
    safe = ids.long().clamp(0, kmax.shape[0] - 1)
    scores = quest_row_shares(q, kmax[safe], kmin[safe], scale, valid).sum(dim=1)  # [R, N]; rows without any: NaN
    middle = (position > 0) & (position < num_valid[:, None] - 1)
    return scores.masked_fill(~middle, float("-inf"))


def quest_select_rows(query: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, ids: torch.Tensor,
                      num_valid: torch.Tensor, scale: float, keep: int) -> torch.Tensor:
    """query [R, H, D], kmax/kmin [blocks, KVH, D] (one layer's tables), ids [R, N] block ids (row r's candidates
    are its first num_valid[r]), num_valid [R] int64, 2 <= keep <= N -> [R, keep] chosen ids (ids' dtype): sink,
    newest, then the best of the middle. One launch of quest_select's kernel over the rows where Triton runs,
    else quest_select_rows_reference."""
    width = ids.shape[1]
    if not 2 <= keep <= width:
        raise ValueError(f"keep={keep} must be at least 2 and at most the {width} candidate columns")
    if not select_kernel_fits(query, width):
        return quest_select_rows_reference(query, kmax, kmin, ids, num_valid, scale, keep)
    return launch_select(query, kmax, kmin, ids, num_valid, scale, keep)


def quest_select_rows_reference(query: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, ids: torch.Tensor,
                                num_valid: torch.Tensor, scale: float, keep: int) -> torch.Tensor:
    """quest_select_rows in torch: the rows' scores (quest_row_scores), a top-k and a gather."""
    scores = quest_row_scores(query, kmax, kmin, ids, num_valid, scale)  # [R, N]
    best = torch.topk(scores, keep - 2, dim=1, sorted=False).indices  # [R, keep - 2]
    newest = (num_valid[:, None] - 1).clamp(min=0)  # [R, 1] position of each row's newest block
    return torch.cat([ids[:, :1], ids.gather(1, newest), ids.gather(1, best)], dim=1)
