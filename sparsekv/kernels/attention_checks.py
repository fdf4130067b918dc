"""Argument checks shared by the attention launchers (dense, decode, paged, sparse): q [Sq, H, D], k/v [Sk, KVH, D];
the paged decode's (q [B, H, D] over pages [num_blocks, block_size, KVH, D], fp8 pages with their scales)."""

from __future__ import annotations

import torch

from .fp8_kv import check_fp8_scales

__all__ = ["check_paged_inputs", "check_qkv"]


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


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """paged_decode_attention's arguments: q [B, H, D], k_cache/v_cache [num_blocks, block_size, KVH, D], block_tables
    [B, max_blocks] and context_lens [B] int32/int64; with scales, fp8 pages (fp8_kv.check_fp8_scales)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [B, H, D] and k_cache/v_cache [num_blocks, block_size, KVH, D]; got q "
            f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    B, H, D = q.shape
    KVH = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"head dim mismatch: q {tuple(q.shape)} vs k_cache {tuple(k_cache.shape)}")
    if KVH == 0 or H % KVH != 0:
        raise ValueError(f"q heads H={H} (q {tuple(q.shape)}) must be a multiple of kv heads "
                         f"KVH={KVH} (k_cache {tuple(k_cache.shape)})")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"expected block_tables [B={B}, max_blocks_per_seq]; "
                         f"got {tuple(block_tables.shape)}")
    if tuple(context_lens.shape) != (B,):
        raise ValueError(f"expected context_lens [B={B}]; got {tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"expected {name} int32, got {t.dtype}")
    if scales is not None:
        check_fp8_scales(q, k_cache, v_cache, scales, "paged decode with scales", num_blocks=k_cache.shape[0],
                         kv_names="k_cache/v_cache")
    elif not (q.dtype == k_cache.dtype == v_cache.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k_cache, v_cache must share one float dtype; got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
