"""Merge two partial attention results over disjoint key sets using their log-sum-exps.

lse = logaddexp(lse1, lse2); o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse), in fp32.
A partial with lse = -inf contributes nothing (its o is ignored, even if NaN); when both are
-inf the result is o = 0, lse = -inf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from ._dispatch import alloc_output, cdiv, default_kernels, jit, next_power_of_2, tl

if TYPE_CHECKING:
    from .backend import KernelChoice

__all__ = ["merge_attention_outputs", "merge_attention_outputs_reference"]

MAX_TILE = 4096  # elements of the [BLOCK_H, BLOCK_D] tile one program merges
NUM_WARPS = 4


@jit
def _merge_kernel(
    O1, L1, O2, L2, O, L,
    stride_o1n, stride_o1h, stride_o1d,
    stride_o2n, stride_o2h, stride_o2d,
    stride_on, stride_oh, stride_od,
    stride_l1h, stride_l1n, stride_l2h, stride_l2n, stride_lh, stride_ln,
    H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    h_ok = offs_h < H
    tile_ok = h_ok[:, None] & (offs_d[None, :] < D)  # [BLOCK_H, BLOCK_D]

    lse1 = tl.load(L1 + offs_h * stride_l1h + n * stride_l1n, mask=h_ok, other=float("-inf"))
    lse2 = tl.load(L2 + offs_h * stride_l2h + n * stride_l2n, mask=h_ok, other=float("-inf"))
    m = tl.maximum(lse1, lse2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(lse1 - m_safe)  # [BLOCK_H]; 0 where lse1 = -inf
    w2 = tl.exp(lse2 - m_safe)
    total = w1 + w2
    nonempty = total > 0.0
    inv = tl.where(nonempty, 1.0 / tl.where(nonempty, total, 1.0), 0.0)
    lse = tl.where(nonempty, m_safe + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))

    o1 = tl.load(O1 + n * stride_o1n + offs_h[:, None] * stride_o1h + offs_d[None, :] * stride_o1d,
                 mask=tile_ok, other=0.0).to(tl.float32)
    o2 = tl.load(O2 + n * stride_o2n + offs_h[:, None] * stride_o2h + offs_d[None, :] * stride_o2d,
                 mask=tile_ok, other=0.0).to(tl.float32)
    c1 = tl.where((w1 > 0.0)[:, None], o1 * (w1 * inv)[:, None], 0.0)
    c2 = tl.where((w2 > 0.0)[:, None], o2 * (w2 * inv)[:, None], 0.0)
    out = c1 + c2  # [BLOCK_H, BLOCK_D]
    tl.store(O + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=tile_ok)
    tl.store(L + offs_h * stride_lh + n * stride_ln, lse, mask=h_ok)


def _check_inputs(o1, lse1, o2, lse2) -> None:
    if o1.dim() != 3 or o1.shape != o2.shape:
        raise ValueError(
            f"expected o1, o2 of one shape [N, H, D]; got o1 {tuple(o1.shape)}, "
            f"o2 {tuple(o2.shape)}")
    N, H, _ = o1.shape
    for name, lse in (("lse1", lse1), ("lse2", lse2)):
        if tuple(lse.shape) != (H, N):
            raise ValueError(
                f"expected {name} of shape [H, N] = {(H, N)} for o1 {tuple(o1.shape)}; "
                f"got {tuple(lse.shape)}")
        if lse.dtype != torch.float32:
            raise ValueError(f"expected {name} float32, got {lse.dtype}")
    if o1.dtype != o2.dtype or not o1.dtype.is_floating_point:
        raise ValueError(f"o1, o2 must share one float dtype; got {o1.dtype}, {o2.dtype}")


def merge_attention_outputs_reference(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch fp32 merge. o1, o2 [N, H, D]; lse1, lse2 [H, N] -> (o [N, H, D], lse [H, N])."""
    _check_inputs(o1, lse1, o2, lse2)
    lse = torch.logaddexp(lse1, lse2)  # [H, N]; -inf when both are -inf
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)
    w1 = torch.exp(lse1 - lse_safe).transpose(0, 1)[..., None]  # [N, H, 1]
    w2 = torch.exp(lse2 - lse_safe).transpose(0, 1)[..., None]
    c1 = torch.where(w1 > 0, o1.float() * w1, 0.0)  # ignore o of an empty partial (may be NaN)
    c2 = torch.where(w2 > 0, o2.float() * w2, 0.0)
    return (c1 + c2).to(o1.dtype), lse


def merge_attention_outputs(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, *,
    kernels: KernelChoice | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention outputs. o1, o2 [N, H, D]; lse1, lse2 [H, N] fp32.

    Returns (o [N, H, D] in o1.dtype, lse [H, N] fp32). ``kernels`` picks Triton or the reference (default: the
    process default for o1's device).
    """
    _check_inputs(o1, lse1, o2, lse2)
    if not (kernels if kernels is not None else default_kernels(o1.device)).triton:
        return merge_attention_outputs_reference(o1, lse1, o2, lse2)
    N, H, D = o1.shape
    o = alloc_output((N, H, D), o1.dtype, o1.device)  # [N, H, D]
    lse = alloc_output((H, N), torch.float32, o1.device)  # [H, N]
    if N == 0 or H == 0:
        return o, lse
    if D == 0:
        return o, torch.logaddexp(lse1, lse2)
    block_d = next_power_of_2(D)
    block_h = min(next_power_of_2(H), max(1, MAX_TILE // block_d))
    grid = (N, cdiv(H, block_h))
    _merge_kernel[grid](
        o1, lse1, o2, lse2, o, lse,
        *o1.stride(), *o2.stride(), *o.stride(), *lse1.stride(), *lse2.stride(), *lse.stride(),
        H, D, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=NUM_WARPS,
    )
    return o, lse
