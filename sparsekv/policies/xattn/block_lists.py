"""Per-query-block key-block selections of block-sparse attention: sorted lists, and the runs the kernel loops over.

block_lists_from_mask(keep [nqb, nkb] bool) -> (block_idx [nqb, nkb] int32, block_count [nqb] int32): each row's
kept key blocks ascending, then padding (the interface of block_sparse_attention).

block_runs(block_idx, block_count, qb0) -> BlockRuns: what block_sparse_attention's kernel reads per query block
qb0 + r. The listed blocks before the query block (every key visible to every row: no mask) as runs of consecutive
blocks [lo, hi), their total n_full, and whether the query block's own (diagonal) block is listed; listed blocks
after it see no query and are dropped. A sink block, a local band or a vertical stripe of blocks is one run, and
every block before the diagonal one run, so the kernel walks each run with plain affine addresses.

Device ops only (no host sync). Entries past block_count are never read; lists are sorted without duplicates.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["BlockRuns", "block_lists_from_mask", "block_mask_from_lists", "block_runs"]

_SENTINEL = 1 << 30


class BlockRuns(NamedTuple):
    """Per query block r (all int32, [nqb] or [nqb, W] with W >= 1): idx, the list (its first n_full entries are
    the blocks before the query block); lo/hi [nqb, W], the runs' first and one-past-last block (entries past
    n_runs are padding); n_full, n_runs; diag, 1 where the query block's own block is listed."""
    idx: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    n_full: torch.Tensor
    n_runs: torch.Tensor
    diag: torch.Tensor


def block_lists_from_mask(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [nqb, nkb] bool -> (block_idx [nqb, nkb] int32: each row's kept key blocks ascending, then padding;
    block_count [nqb] int32). Device ops only: no host sync."""
    if not isinstance(keep, torch.Tensor) or keep.dim() != 2 or keep.dtype != torch.bool:
        shape = (tuple(keep.shape), keep.dtype) if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"expected keep as a bool tensor [nqb, nkb]; got {shape}")
    ids = torch.arange(keep.shape[1], dtype=torch.int32, device=keep.device)
    block_idx = torch.where(keep, ids, _SENTINEL).to(torch.int32).sort(dim=1).values
    return block_idx, keep.sum(dim=1, dtype=torch.int32)


def block_mask_from_lists(block_idx: torch.Tensor, block_count: torch.Tensor, nkb: int) -> torch.Tensor:
    """[nqb, nkb] bool of the listed blocks (padding and out-of-range entries ignored)."""
    idx = block_idx.long()
    listed = torch.arange(idx.shape[1], device=idx.device)[None, :] < block_count.long()[:, None]
    idx = torch.where(listed & (idx >= 0) & (idx < nkb), idx, nkb)
    mask = torch.zeros((idx.shape[0], nkb + 1), dtype=torch.bool, device=idx.device)
    mask.scatter_(1, idx, True)
    return mask[:, :nkb]


def _compact(flags: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[nqb, W] -> [nqb, W]: each row's values where flags is set, moved to the front in order (rest zero)."""
    nqb, width = flags.shape
    slot = torch.where(flags, flags.cumsum(dim=1) - 1, width)  # one spare column takes the unflagged entries
    out = torch.zeros((nqb, width + 1), dtype=torch.int32, device=flags.device)
    out.scatter_(1, slot, values)
    return out[:, :width].contiguous()


def block_runs(block_idx: torch.Tensor, block_count: torch.Tensor, qb0: int) -> BlockRuns:
    """Runs of the sorted lists block_idx [nqb, W] / block_count [nqb] of query blocks qb0.. (see the module
    docstring). Device ops only: no host sync."""
    nqb, width = block_idx.shape
    dev = block_idx.device
    idx = block_idx.to(torch.int32)
    count = block_count.to(torch.int32)
    if width == 0:  # nothing listed anywhere: the kernel still needs valid pointers
        idx = torch.zeros((nqb, 1), dtype=torch.int32, device=dev)
        count = torch.zeros_like(count)
    qb = torch.arange(qb0, qb0 + nqb, dtype=torch.int32, device=dev)[:, None]  # [nqb, 1] absolute query block
    listed = torch.arange(idx.shape[1], device=dev)[None, :] < count[:, None]  # [nqb, W]
    full = listed & (idx < qb)  # sorted: a prefix of each row
    n_full = full.sum(dim=1, dtype=torch.int32)
    diag = (listed & (idx == qb)).any(dim=1).to(torch.int32)
    false = torch.zeros((nqb, 1), dtype=torch.bool, device=dev)
    consecutive = full[:, 1:] & full[:, :-1] & (idx[:, 1:] == idx[:, :-1] + 1)
    joins_prev = torch.cat([false, consecutive], dim=1)  # [nqb, W]: continues the run of the entry before
    joins_next = torch.cat([joins_prev[:, 1:], false], dim=1)
    starts, ends = full & ~joins_prev, full & ~joins_next
    return BlockRuns(idx.contiguous(), _compact(starts, idx), _compact(ends, idx + 1), n_full,
                     starts.sum(dim=1, dtype=torch.int32), diag)
