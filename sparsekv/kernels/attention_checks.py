"""Argument checks shared by the attention launchers (dense, decode, paged, sparse): q [Sq, H, D], k/v [Sk, KVH, D]."""

from __future__ import annotations

import torch

__all__ = ["check_qkv"]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape, dtype and device checks shared by every attention launcher: q [Sq, H, D], k/v [Sk, KVH, D]."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"expected q [Sq, H, D], k/v [Sk, KVH, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dim mismatch: q {tuple(q.shape)} vs k {tuple(k.shape)}")
    H, KVH = q.shape[1], k.shape[1]
    if KVH == 0 or H % KVH != 0:
        raise ValueError(
            f"q heads H={H} (q {tuple(q.shape)}) must be a multiple of kv heads KVH={KVH} "
            f"(k {tuple(k.shape)})")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(
            f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
