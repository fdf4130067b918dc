"""Third-party attention kernels behind flash_attn_with_lse's 'flash_attn', 'sdpa' and 'cudnn' backends, adapted
to its contract: q [Sq, H, D], k/v [Sk, KVH, D] -> o [Sq, H, D], lse [H, Sq] fp32 (natural log, -inf for rows
with no visible key)."""

from __future__ import annotations

import torch

__all__ = ["flash_attn_package", "torch_fused_attention"]


def flash_attn_package(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(
        q[None], k[None], v[None], softmax_scale=scale, causal=causal, return_attn_probs=True)
    lse = lse[0].float()  # [H, Sq]; flash-attn marks rows with no visible key with +inf
    lse = torch.where(torch.isposinf(lse), float("-inf"), lse)
    return out[0], lse


def torch_fused_attention(q, k, v, scale: float, causal: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused kernels (sdpa: flash; cudnn: cuDNN). They want [B, H, S, D] with equal head counts, and their
    causal mask is top-left aligned, which equals ours only when Sq == Sk (checked by attention_backend)."""
    Sq, H = q.shape[0], q.shape[1]
    KVH = k.shape[1]
    if H != KVH:
        k = k.repeat_interleave(H // KVH, dim=1)  # [Sk, H, D]
        v = v.repeat_interleave(H // KVH, dim=1)
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, S, D]
    if backend == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False,
                                                                 scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]  # [1, H, Sq, D], natural-log lse with H * Sq entries
    return out[0].transpose(0, 1).contiguous(), lse.reshape(H, Sq).float().contiguous()
