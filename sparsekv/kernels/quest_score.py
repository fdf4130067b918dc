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

__all__ = ["quest_block_shares", "quest_block_shares_reference", "quest_select", "quest_select_reference"]

BLOCK_B = 16  # candidate blocks per inner step
NUM_WARPS = 4
SELECT_MAX_CANDIDATES = 16384  # quest_select holds every candidate's score in one program


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
def _kv_head_shares(Q, KMAX, KMIN, IDS, OUT, stride_qh, stride_kb, stride_kh, stride_mb, stride_mh, kv_head, n, scale,
                    accumulate, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_B: tl.constexpr):
    # OUT[b] (+)= max over the KV head's query heads of the block's softmax share, for the n candidates
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
        share = tl.max(tl.where(g_ok[:, None], share, 0.0), axis=0)  # [BB]
        share += tl.load(OUT + start + offs_b, mask=b_ok & accumulate, other=0.0)
        tl.store(OUT + start + offs_b, share, mask=b_ok)


@jit
def _quest_shares_kernel(
    Q, KMAX, KMIN, IDS, OUT,
    stride_qh, stride_kb, stride_kh, stride_mb, stride_mh, stride_oh,
    n, scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr,
):
    kv_head = tl.program_id(0)
    _kv_head_shares(Q, KMAX, KMIN, IDS, OUT + kv_head * stride_oh, stride_qh, stride_kb, stride_kh, stride_mb,
                    stride_mh, kv_head, n, scale, False, GROUP, BLOCK_G, HEAD_DIM, BLOCK_B)


@jit
def _quest_select_kernel(
    Q, KMAX, KMIN, IDS, SCORES, CHOSEN,
    stride_qh, stride_kb, stride_kh, stride_mb, stride_mh,
    n, scale, keep_middle,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # one program: every KV head's shares summed into SCORES [n], then CHOSEN = sink, newest, best of the middle
    for kv_head in range(KV_HEADS):
        _kv_head_shares(Q, KMAX, KMIN, IDS, SCORES, stride_qh, stride_kb, stride_kh, stride_mb, stride_mh,
                        kv_head, n, scale, kv_head > 0, GROUP, BLOCK_G, HEAD_DIM, BLOCK_B)
        tl.debug_barrier()  # the next head (and the selection) reads what every thread stored
    offs = tl.arange(0, BLOCK_N)
    middle = (offs > 0) & (offs < n - 1)
    score = tl.load(SCORES + offs, mask=middle, other=float("-inf"))  # [BLOCK_N]
    tl.store(CHOSEN, tl.load(IDS))
    tl.store(CHOSEN + 1, tl.load(IDS + n - 1))
    for j in range(keep_middle):  # the keep_middle largest, one argmax at a time (keep is small)
        best = tl.argmax(score, axis=0)
        tl.store(CHOSEN + 2 + j, tl.load(IDS + best))
        score = tl.where(offs == best, float("-inf"), score)


def quest_select_reference(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, block_ids: torch.Tensor,
                           scale: float, keep: int) -> torch.Tensor:
    """[keep] int64: block_ids' first and last, then the keep - 2 middle ones of largest summed share."""
    scores = quest_block_shares_reference(q, kmax, kmin, block_ids, scale).sum(dim=0)  # [n]
    middle = torch.topk(scores[1:-1], keep - 2, sorted=False).indices + 1
    return torch.cat([block_ids[:1], block_ids[-1:], block_ids[middle]])


def quest_select(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, block_ids: torch.Tensor, scale: float,
                 keep: int) -> torch.Tensor:
    """Quest's decode choice in one launch: q [H, D], kmax/kmin [blocks, KVH, D] (one layer's tables), block_ids [n]
    int64 candidates (2 <= keep < n) -> [keep] int64 chosen ids, first the sink and the newest. No host sync."""
    _check(q, kmax, kmin, block_ids)
    n = block_ids.shape[0]
    if not 2 <= keep < n:
        raise ValueError(f"keep={keep} must be at least 2 and below the {n} candidates")
    dim = q.shape[1]
    block_n = next_power_of_2(n)
    if not use_triton(q.device) or dim != next_power_of_2(dim) or block_n > SELECT_MAX_CANDIDATES:
        return quest_select_reference(q, kmax, kmin, block_ids, scale, keep)
    q, kmax, kmin = _last_dim_contiguous(q, kmax, kmin)
    group = q.shape[0] // kmax.shape[1]
    scores = torch.empty(n, dtype=torch.float32, device=q.device)
    chosen = torch.empty(keep, dtype=torch.int64, device=q.device)  # the kernel writes every entry
    _quest_select_kernel[(1,)](
        q, kmax, kmin, block_ids, scores, chosen,
        q.stride(0), kmax.stride(0), kmax.stride(1), kmin.stride(0), kmin.stride(1),
        n, float(scale), keep - 2,
        KV_HEADS=kmax.shape[1], GROUP=group, BLOCK_G=max(2, next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_B=8 if triton_interpret() else BLOCK_B, BLOCK_N=block_n, num_warps=NUM_WARPS,
    )
    return chosen


def _check(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, block_ids: torch.Tensor) -> None:
    if q.dim() != 2 or kmax.dim() != 3 or kmax.shape != kmin.shape or q.shape[1] != kmax.shape[2]:
        raise ValueError(f"expected q [H, D] and kmax/kmin [blocks, KVH, D]; got q {tuple(q.shape)}, "
                         f"kmax {tuple(kmax.shape)}, kmin {tuple(kmin.shape)}")
    if q.shape[0] % kmax.shape[1]:
        raise ValueError(f"query heads {q.shape[0]} must be a multiple of KV heads {kmax.shape[1]}")
    if block_ids.dim() != 1 or block_ids.dtype != torch.int64:
        raise ValueError(f"expected block_ids [n] int64; got {tuple(block_ids.shape)} {block_ids.dtype}")


def _last_dim_contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def quest_block_shares(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, block_ids: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [H, D], kmax/kmin [blocks, KVH, D] (one layer's tables), block_ids [n] int64 -> [KVH, n] fp32.

    Triton where :func:`use_triton` says so, else the reference.
    """
    _check(q, kmax, kmin, block_ids)
    heads, dim = q.shape
    kv_heads = kmax.shape[1]
    n = block_ids.shape[0]
    if not use_triton(q.device) or n == 0 or dim != next_power_of_2(dim):
        return quest_block_shares_reference(q, kmax, kmin, block_ids, scale)
    q, kmax, kmin = _last_dim_contiguous(q, kmax, kmin)
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
