"""How many (query, key) pairs vertical_slash_attention computes, for its density figure.

vertical_slash_pair_count(Sq, Sk, q_offset, vertical_idx [H, NV], slash_offsets [H, NS]) -> [H] int64 on the device
visible_pair_count(Sq, Sk, q_offset) -> int: the causally visible pairs (the density's denominator per head)
"""
from __future__ import annotations

import torch

__all__ = ["vertical_slash_pair_count", "visible_pair_count"]


def _first_of_each_value(x: torch.Tensor) -> torch.Tensor:
    """x [H, N] sorted per row -> bool [H, N]: True at the first entry of each distinct value."""
    first = torch.ones_like(x, dtype=torch.bool)
    first[:, 1:] = x[:, 1:] != x[:, :-1]
    return first


def vertical_slash_pair_count(
    Sq: int, Sk: int, q_offset: int, vertical_idx: torch.Tensor, slash_offsets: torch.Tensor,
) -> torch.Tensor:
    """Number of (query, key) pairs [H] (int64, on the index device) that vertical_slash_attention computes for
    this selection, from the index lists alone: O(H * (NV + NS) log), no mask, no host sync. Entries need not be
    sorted or unique; out-of-range ones count nothing, as in the attention.

    pairs = (rows on each selected diagonal) + (rows below each selected column) - (column-diagonal crossings):
    a key on a selected column and a selected diagonal is one pair."""
    H = vertical_idx.shape[0]
    dev = vertical_idx.device
    if Sq == 0 or Sk == 0:
        return torch.zeros(H, dtype=torch.int64, device=dev)
    p_lo, p_hi = q_offset, q_offset + Sq - 1  # query positions
    d = slash_offsets.long().sort(dim=1).values  # [H, NS]
    c = vertical_idx.long().sort(dim=1).values  # [H, NV]
    d_used = _first_of_each_value(d) & (d >= 0)
    c_used = _first_of_each_value(c) & (c >= 0) & (c < Sk)
    # rows p in [p_lo, p_hi] with 0 <= p - d < Sk, and rows p >= c
    diag_rows = (torch.minimum(d + Sk - 1, torch.full_like(d, p_hi)) - torch.clamp(d, min=p_lo) + 1).clamp(min=0)
    col_rows = (p_hi - torch.clamp(c, min=p_lo) + 1).clamp(min=0)
    pairs = (diag_rows * d_used).sum(1) + (col_rows * c_used).sum(1)
    if d.shape[1] == 0 or c.shape[1] == 0:
        return pairs
    # column c meets diagonal d at a query row when p_lo <= c + d <= p_hi: count the used d in that range
    used_before = torch.nn.functional.pad(d_used.long().cumsum(1), (1, 0))  # [H, NS + 1]
    lo = torch.searchsorted(d, (p_lo - c).clamp(min=0))  # [H, NV]
    hi = torch.searchsorted(d, p_hi - c, right=True)
    crossings = (used_before.gather(1, hi) - used_before.gather(1, lo)).clamp(min=0)
    return pairs - (crossings * c_used).sum(1)


def visible_pair_count(Sq: int, Sk: int, q_offset: int) -> int:
    """Causally visible (query, key) pairs: sum over rows p of min(p + 1, Sk)."""
    total = 0
    p_lo, p_hi = q_offset, q_offset + Sq - 1
    if Sq <= 0 or Sk <= 0:
        return 0
    # rows with p + 1 <= Sk contribute p + 1; the rest contribute Sk
    split = min(p_hi, Sk - 1)
    if split >= p_lo:
        total += (p_lo + 1 + split + 1) * (split - p_lo + 1) // 2
    total += max(0, p_hi - max(p_lo, Sk) + 1) * Sk
    return total
