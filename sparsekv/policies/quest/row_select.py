"""Quest's decode choice for rows of (query, candidate blocks) at once: the batched selection of the offloaded store
(candidates padded to the longest row) and of the resident store (each row's full blocks in its block table).

A row keeps its first candidate (attention sink), its newest (the last valid one) and the keep - 2 middle blocks of
largest summed share: the choice quest_select makes for one query. The scores of every row are one kernel launch
(quest_row_scores, one program per row: it reads only the row's num_valid candidates, their number read on the
device), the choice a top-k and a gather; nothing syncs with the host. Rows without keep valid candidates get
meaningless ids (callers ignore them).
"""
from __future__ import annotations

import torch

from sparsekv.kernels._dispatch import alloc_output, jit, next_power_of_2, tl, triton_interpret, use_triton
from sparsekv.policies.quest.quest_score import BLOCK_B, NUM_WARPS, _group_bounds, _group_query, quest_row_shares

__all__ = ["quest_row_scores", "quest_row_scores_reference", "quest_select_rows"]


def quest_row_scores_reference(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, ids: torch.Tensor,
                               num_valid: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, H, D], kmax/kmin [blocks, KVH, D], ids [R, N] int, num_valid [R] -> [R, N] fp32: each middle candidate's
    share summed over KV heads (0 < position < num_valid - 1), -inf elsewhere (sink, newest, padding)."""
    position = torch.arange(ids.shape[1], device=ids.device)[None, :]  # [1, N]
    valid = position < num_valid[:, None]  # [R, N]
    safe = ids.long().clamp(0, kmax.shape[0] - 1)
    scores = quest_row_shares(q, kmax[safe], kmin[safe], scale, valid).sum(dim=1)  # [R, N]; rows without any: NaN
    middle = (position > 0) & (position < num_valid[:, None] - 1)
    return scores.masked_fill(~middle, float("-inf"))


@jit
def _quest_row_scores_kernel(
    Q, KMAX, KMIN, IDS, NUM, OUT,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_mb, stride_mh, stride_ib, stride_ob,
    width, scale,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # OUT[row, b] = sum over KV heads of (max over the head's query heads of block b's softmax share among the row's
    # n candidates), for 0 < b < n - 1; -inf elsewhere. One program per row; the KV heads add up in OUT in order.
    row = tl.program_id(0)
    n = tl.load(NUM + row).to(tl.int32)
    ids = IDS + row * stride_ib
    out = OUT + row * stride_ob
    g_ok = tl.arange(0, BLOCK_G) < GROUP
    offs_b = tl.arange(0, BLOCK_B)
    for kv_head in tl.static_range(KV_HEADS):
        q_pos, q_neg = _group_query(Q + row * stride_qb, stride_qh, kv_head, GROUP, BLOCK_G, HEAD_DIM)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        for start in range(0, n, BLOCK_B):  # pass 1: softmax max and sum over the row's candidates
            s, b_ok = _group_bounds(q_pos, q_neg, KMAX, KMIN, ids, stride_kb, stride_kh, stride_mb, stride_mh,
                                    kv_head, start, n, scale, HEAD_DIM, BLOCK_B)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
            m_i = m_new
        m_i = tl.where(l_i > 0.0, m_i, 0.0)  # a row without candidates (padding): shares exp(-inf) / 1 = 0
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
        for start in range(0, width, BLOCK_B):  # pass 2: shares, max over the group, added to the earlier heads'
            s, b_ok = _group_bounds(q_pos, q_neg, KMAX, KMIN, ids, stride_kb, stride_kh, stride_mb, stride_mh,
                                    kv_head, start, n, scale, HEAD_DIM, BLOCK_B)
            share = tl.exp(s - m_i[:, None]) / l_i[:, None]
            share = tl.where(b_ok, tl.max(tl.where(g_ok[:, None], share, 0.0), axis=0), 0.0)  # [BB]
            offs = start + offs_b
            if kv_head > 0:
                share += tl.load(out + offs, mask=offs < width, other=0.0)
            if kv_head == KV_HEADS - 1:
                share = tl.where((offs > 0) & (offs < n - 1), share, float("-inf"))
            tl.store(out + offs, share, mask=offs < width)
        tl.debug_barrier()  # the next head's threads read back what this head's stored


def quest_row_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, ids: torch.Tensor,
                     num_valid: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, H, D], kmax/kmin [blocks, KVH, D] (one layer's tables), ids [R, N] int32/int64 (row r's candidates are
    its first num_valid[r]; the ids after them are never read), num_valid [R] int -> [R, N] fp32 middle scores (see
    the reference). One launch where use_triton says so, else the reference."""
    rows, heads, dim = q.shape
    kv_heads = kmax.shape[1]
    if kmax.dim() != 3 or kmax.shape != kmin.shape or kmax.shape[2] != dim or heads % kv_heads:
        raise ValueError(f"expected q [R, H, D] and kmax/kmin [blocks, KVH, D] with H a multiple of KVH; got q "
                         f"{tuple(q.shape)}, kmax {tuple(kmax.shape)}, kmin {tuple(kmin.shape)}")
    if ids.dim() != 2 or ids.shape[0] != rows or num_valid.shape != (rows,):
        raise ValueError(f"expected ids [R={rows}, N] and num_valid [R]; got {tuple(ids.shape)}, "
                         f"{tuple(num_valid.shape)}")
    width = ids.shape[1]
    if not use_triton(q.device) or dim != next_power_of_2(dim) or rows == 0 or width == 0:
        return quest_row_scores_reference(q, kmax, kmin, ids, num_valid, scale)
    q, kmax, kmin, ids, num_valid = (t if t.stride(-1) == 1 else t.contiguous()
                                     for t in (q, kmax, kmin, ids, num_valid))
    out = alloc_output((rows, width), torch.float32, q.device)
    group = heads // kv_heads
    _quest_row_scores_kernel[(rows,)](
        q, kmax, kmin, ids, num_valid, out,
        q.stride(0), q.stride(1), kmax.stride(0), kmax.stride(1), kmin.stride(0), kmin.stride(1), ids.stride(0),
        out.stride(0), width, float(scale),
        KV_HEADS=kv_heads, GROUP=group, BLOCK_G=max(2, next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_B=8 if triton_interpret() else BLOCK_B, num_warps=NUM_WARPS,
    )
    return out


def quest_select_rows(query: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, ids: torch.Tensor,
                      num_valid: torch.Tensor, scale: float, keep: int) -> torch.Tensor:
    """query [R, H, D], kmax/kmin [blocks, KVH, D] (one layer's tables), ids [R, N] block ids (row r's candidates
    are its first num_valid[r]), num_valid [R] int64, 2 <= keep <= N -> [R, keep] chosen ids (ids' dtype): sink,
    newest, then the best of the middle."""
    width = ids.shape[1]
    if not 2 <= keep <= width:
        raise ValueError(f"keep={keep} must be at least 2 and at most the {width} candidate columns")
    scores = quest_row_scores(query, kmax, kmin, ids, num_valid, scale)  # [R, N]
    best = torch.topk(scores, keep - 2, dim=1, sorted=False).indices  # [R, keep - 2]
    newest = (num_valid[:, None] - 1).clamp(min=0)  # [R, 1] position of each row's newest block
    return torch.cat([ids[:, :1], ids.gather(1, newest), ids.gather(1, best)], dim=1)
