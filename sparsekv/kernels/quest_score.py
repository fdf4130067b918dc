"""Quest block scores for one decode query in one launch.

quest_block_shares(q [H, D], kmax/kmin [blocks, KVH, D], block_ids [n]) -> shares [KVH, n] fp32:
for each candidate block and query head the per-channel upper bound of q.k over the block's keys,
    bound = sum_d max(q_d * kmax_d, q_d * kmin_d),
turned into an attention share by a softmax of bound * scale over the n blocks (per query head), then the
largest share of the KV head's GQA group. Summing over KV heads (one small op) gives the block score Quest ranks.

One program per KV head: two passes over the candidates (online max/sum of the softmax, then the shares), the
bounds recomputed in the second pass rather than stored. Replaces ~15 small torch ops per layer and decode step
(gathers, casts, clamps, two einsums, softmax, max) whose launch costs dominated Quest's offloaded decode.
"""

from __future__ import annotations

import torch

from ._dispatch import alloc_output, jit, next_power_of_2, tl, triton_interpret, use_triton

__all__ = ["quest_block_shares", "quest_block_shares_reference"]

BLOCK_B = 16  # candidate blocks per inner step
NUM_WARPS = 4


def quest_block_shares_reference(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, block_ids: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """q [H, D], kmax/kmin [blocks, KVH, D], block_ids [n] int64 -> [KVH, n] fp32."""
    hi = kmax.index_select(0, block_ids).float()  # [n, KVH, D]
    lo = kmin.index_select(0, block_ids).float()
    heads, dim = q.shape
    kv_heads = hi.shape[1]
    qg = q.float().view(kv_heads, heads // kv_heads, dim)  # [KVH, G, D]
    bound = (torch.einsum("kgd,nkd->kgn", qg.clamp(min=0), hi)
             + torch.einsum("kgd,nkd->kgn", qg.clamp(max=0), lo))  # [KVH, G, n]
    return torch.softmax(bound * scale, dim=2).amax(dim=1)  # [KVH, n]


@jit
def _quest_shares_kernel(
    Q, KMAX, KMIN, IDS, OUT,
    stride_qh, stride_kb, stride_kh, stride_mb, stride_mh, stride_oh,
    n, scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr,
):
    kv_head = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)  # [G] query heads of the group (padded)
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    offs_b = tl.arange(0, BLOCK_B)  # [BB]
    g_ok = offs_g < GROUP
    q = tl.load(Q + (kv_head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0).to(tl.float32)  # [G, D]
    q_pos = tl.maximum(q, 0.0)[:, None, :]  # [G, 1, D]
    q_neg = tl.minimum(q, 0.0)[:, None, :]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for start in range(0, n, BLOCK_B):  # pass 1: softmax max and sum over the candidates
        b_ok = start + offs_b < n
        ids = tl.load(IDS + start + offs_b, mask=b_ok, other=0).to(tl.int64)
        hi = tl.load(KMAX + ids[:, None] * stride_kb + kv_head * stride_kh + offs_d[None, :],
                     mask=b_ok[:, None], other=0.0).to(tl.float32)  # [BB, D]
        lo = tl.load(KMIN + ids[:, None] * stride_mb + kv_head * stride_mh + offs_d[None, :],
                     mask=b_ok[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q_pos * hi[None, :, :] + q_neg * lo[None, :, :], axis=2) * scale  # [G, BB]
        s = tl.where(b_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    for start in range(0, n, BLOCK_B):  # pass 2: shares, max over the group
        b_ok = start + offs_b < n
        ids = tl.load(IDS + start + offs_b, mask=b_ok, other=0).to(tl.int64)
        hi = tl.load(KMAX + ids[:, None] * stride_kb + kv_head * stride_kh + offs_d[None, :],
                     mask=b_ok[:, None], other=0.0).to(tl.float32)
        lo = tl.load(KMIN + ids[:, None] * stride_mb + kv_head * stride_mh + offs_d[None, :],
                     mask=b_ok[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q_pos * hi[None, :, :] + q_neg * lo[None, :, :], axis=2) * scale  # [G, BB]
        share = tl.exp(s - m_i[:, None]) / l_i[:, None]
        share = tl.where(g_ok[:, None], share, 0.0)
        tl.store(OUT + kv_head * stride_oh + start + offs_b, tl.max(share, axis=0), mask=b_ok)


def quest_block_shares(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, block_ids: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [H, D], kmax/kmin [blocks, KVH, D] (one layer's tables), block_ids [n] int64 -> [KVH, n] fp32.

    Triton where :func:`use_triton` says so, else the reference.
    """
    if q.dim() != 2 or kmax.dim() != 3 or kmax.shape != kmin.shape or q.shape[1] != kmax.shape[2]:
        raise ValueError(f"expected q [H, D] and kmax/kmin [blocks, KVH, D]; got q {tuple(q.shape)}, "
                         f"kmax {tuple(kmax.shape)}, kmin {tuple(kmin.shape)}")
    heads, dim = q.shape
    kv_heads = kmax.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of KV heads {kv_heads}")
    if block_ids.dim() != 1 or block_ids.dtype != torch.int64:
        raise ValueError(f"expected block_ids [n] int64; got {tuple(block_ids.shape)} {block_ids.dtype}")
    n = block_ids.shape[0]
    if not use_triton(q.device) or n == 0 or dim != next_power_of_2(dim):
        return quest_block_shares_reference(q, kmax, kmin, block_ids, scale)
    if q.stride(1) != 1 or kmax.stride(2) != 1 or kmin.stride(2) != 1:
        q, kmax, kmin = q.contiguous(), kmax.contiguous(), kmin.contiguous()
    group = heads // kv_heads
    out = alloc_output((kv_heads, n), torch.float32, q.device)
    _quest_shares_kernel[(kv_heads,)](
        q, kmax, kmin, block_ids, out,
        q.stride(0), kmax.stride(0), kmax.stride(1), kmin.stride(0), kmin.stride(1), out.stride(0),
        n, float(scale),
        GROUP=group, BLOCK_G=max(2, next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_B=8 if triton_interpret() else BLOCK_B, num_warps=NUM_WARPS,
    )
    return out
