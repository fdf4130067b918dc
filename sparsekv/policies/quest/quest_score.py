"""Quest block scores and Quest's decode choice for one decode query.

For a query head and a candidate block, bound = sum_d max(q_d * kmax_d, q_d * kmin_d) (q+ . kmax + q- . kmin) caps
q.k over the block's keys; a softmax of bound * scale over the n candidates (per query head) turns it into an
attention share, and a KV head needs a block as much as the most interested query head of its GQA group.

quest_block_shares(q [H, D], kmax/kmin [blocks, KVH, D], block_ids [n]) -> shares [KVH, n] fp32: one program per KV
head, two passes over the candidates (online softmax max/sum, then the shares; bounds recomputed, not stored).

quest_select(..., keep) -> [keep] chosen ids (sink, newest, the keep - 2 middle blocks of largest share summed over KV
heads) in one launch of grid (KVH, cdiv(n, BLOCK_B)): each program stores its KV head's scaled bounds for BLOCK_B
candidates and their per-head partial softmax max/sum into an fp32 scratch, then bumps a cached device counter; the
program that finishes last combines the partials, reads every bound once to score the n blocks, picks the keep, and
resets the counter. Launches on one device must therefore be stream-ordered (they share the counters).
launch_select runs the same kernel over R rows of (query, candidates) at once, grid (KVH, cdiv(N, BLOCK_B), R), with
a scratch and a counter per row: the batched decode choice (sparsekv/policies/quest/row_select.py).
"""

from __future__ import annotations

import torch

from sparsekv.kernels._dispatch import alloc_output, cdiv, jit, next_power_of_2, tl, triton_interpret, use_triton

__all__ = ["launch_select", "quest_block_shares", "quest_block_shares_reference", "quest_select",
           "quest_select_reference", "select_kernel_fits"]

BLOCK_B = 16  # candidate blocks per bound tile
NUM_WARPS = 4
SELECT_MAX_CANDIDATES = 16384  # quest_select's last program holds every candidate's score at once
SELECT_TILE = 4096  # elements of the last program's [KVH, G, chunk] tiles of bounds and partials

COUNTER_ROWS = 1024  # rows (queries) one select launch counts without growing its counters
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device and row: finished-program counts, 0 between launches


def quest_block_shares_reference(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, block_ids: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """q [H, D], kmax/kmin [blocks, KVH, D], block_ids [n] int64 -> [KVH, n] fp32."""
    hi = kmax.index_select(0, block_ids)[None]  # [1, n, KVH, D]
    lo = kmin.index_select(0, block_ids)[None]
    return quest_row_shares(q[None], hi, lo, scale)[0]


def quest_row_shares(q: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, scale: float,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of (query, candidate blocks): q [R, H, D], hi/lo [R, n, KVH, D] (the blocks' key max/min), valid [R, n]
    (False: padding, share 0) -> [R, KVH, n] fp32, each block's softmax share of the upper bounds
    sum_i max(q_i * kmax_i, q_i * kmin_i), the max over the query heads of a KV head."""
    rows, heads, dim = q.shape
    kv_heads = hi.shape[2]
    qg = q.float().view(rows, kv_heads, heads // kv_heads, dim)  # [R, KVH, G, D]
    bound = (torch.einsum("rkgd,rnkd->rkgn", qg.clamp(min=0), hi.float())
             + torch.einsum("rkgd,rnkd->rkgn", qg.clamp(max=0), lo.float()))  # [R, KVH, G, n]
    if valid is not None:
        bound = bound.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(bound * scale, dim=3).amax(dim=2)  # [R, KVH, n]


@jit
def _group_query(Q, stride_qh, kv_head, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
    # q+ and q- [BLOCK_G, 1, D] of the KV head's query heads (padding rows 0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (kv_head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None], other=0.0).to(tl.float32)  # [G, D]
    return tl.maximum(q, 0.0)[:, None, :], tl.minimum(q, 0.0)[:, None, :]


@jit
def _group_bounds(q_pos, q_neg, KMAX, KMIN, IDS, stride_kb, stride_kh, stride_mb, stride_mh, kv_head, start, n, scale,
                  HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr):
    # scaled bounds [G, BLOCK_B] of candidates start.. (-inf past n) and their mask [BLOCK_B]
    offs_d = tl.arange(0, HEAD_DIM)
    b_ok = start + tl.arange(0, BLOCK_B) < n
    ids = tl.load(IDS + start + tl.arange(0, BLOCK_B), mask=b_ok, other=0).to(tl.int64)
    hi = tl.load(KMAX + ids[:, None] * stride_kb + kv_head * stride_kh + offs_d[None, :],
                 mask=b_ok[:, None], other=0.0).to(tl.float32)  # [BB, D]
    lo = tl.load(KMIN + ids[:, None] * stride_mb + kv_head * stride_mh + offs_d[None, :],
                 mask=b_ok[:, None], other=0.0).to(tl.float32)
    s = tl.sum(q_pos * hi[None, :, :] + q_neg * lo[None, :, :], axis=2) * scale  # [G, BB]
    return tl.where(b_ok[None, :], s, float("-inf")), b_ok


@jit
def _quest_shares_kernel(
    Q, KMAX, KMIN, IDS, OUT,
    stride_qh, stride_kb, stride_kh, stride_mb, stride_mh, stride_oh,
    n, scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # OUT[kv_head, b] = max over the KV head's query heads of the block's softmax share
    kv_head = tl.program_id(0)
    g_ok = tl.arange(0, BLOCK_G) < GROUP
    offs_b = tl.arange(0, BLOCK_B)
    q_pos, q_neg = _group_query(Q, stride_qh, kv_head, GROUP, BLOCK_G, HEAD_DIM)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for start in range(0, n, BLOCK_B):  # pass 1: softmax max and sum over the candidates
        s, b_ok = _group_bounds(q_pos, q_neg, KMAX, KMIN, IDS, stride_kb, stride_kh, stride_mb, stride_mh, kv_head,
                                start, n, scale, HEAD_DIM, BLOCK_B)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    for start in range(0, n, BLOCK_B):  # pass 2: shares, max over the group
        s, b_ok = _group_bounds(q_pos, q_neg, KMAX, KMIN, IDS, stride_kb, stride_kh, stride_mb, stride_mh, kv_head,
                                start, n, scale, HEAD_DIM, BLOCK_B)
        share = tl.exp(s - m_i[:, None]) / l_i[:, None]
        share = tl.max(tl.where(g_ok[:, None], share, 0.0), axis=0)  # [BB]
        tl.store(OUT + kv_head * stride_oh + start + offs_b, share, mask=b_ok)


@jit
def _chunk_scores(BOUNDS, width, row, row_ok, m, inv_l, start, n, CHUNK: tl.constexpr):
    # [CHUNK] scores of candidates start..: shares from the stored bounds, max over each group, sum over KV heads
    offs = start + tl.arange(0, CHUNK)
    s = tl.load(BOUNDS + row * width + offs[None, None, :], mask=row_ok & (offs < width)[None, None, :],
                other=float("-inf"), cache_modifier=".cg")  # [KVH, G, CHUNK], vectorised: a mask constant by 16
    s = tl.where((offs < n)[None, None, :], s, float("-inf"))  # the rows' tails, never written
    share = tl.exp(s - m[:, :, None]) * inv_l[:, :, None]  # padding rows and candidates: exp(-inf) = 0
    return tl.sum(tl.max(share, axis=1), axis=0)


@jit
def _quest_select_kernel(
    Q, KMAX, KMIN, IDS, NUM_VALID, SCRATCH, COUNTER, CHOSEN,
    stride_qr, stride_qh, stride_kb, stride_kh, stride_mb, stride_mh, stride_ir,
    n_cols, width, pwidth, scale, keep_middle,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr,
    CHUNK_P: tl.constexpr, HAS_COUNTS: tl.constexpr,
):
    kv_head = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    query = tl.program_id(2)  # one query and its candidates IDS[query, :n] (n = NUM_VALID[query], else n_cols)
    if HAS_COUNTS:
        n = tl.load(NUM_VALID + query).to(tl.int32)
    else:
        n = n_cols
    # SCRATCH per query (launch_select sizes it): scores [n], bounds [H, n], partial softmax max and sum [H, parts]
    # each, in rows padded to multiples of 16 (width, pwidth) so that the last program's loads are vectorised
    SCORES = SCRATCH + query.to(tl.int64) * ((KV_HEADS * GROUP + 1) * width + 2 * KV_HEADS * GROUP * pwidth)
    BOUNDS = SCORES + width
    PEAK = BOUNDS + KV_HEADS * GROUP * width
    MASS = PEAK + KV_HEADS * GROUP * pwidth
    Q += query.to(tl.int64) * stride_qr
    IDS += query.to(tl.int64) * stride_ir
    COUNTER += query
    CHOSEN += query.to(tl.int64) * (keep_middle + 2)

    q_pos, q_neg = _group_query(Q, stride_qh, kv_head, GROUP, BLOCK_G, HEAD_DIM)
    s, b_ok = _group_bounds(q_pos, q_neg, KMAX, KMIN, IDS, stride_kb, stride_kh, stride_mb, stride_mh, kv_head,
                            part * BLOCK_B, n, scale, HEAD_DIM, BLOCK_B)  # [G, BB]
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < GROUP
    head = kv_head * GROUP + offs_g  # [G] query heads
    tl.store(BOUNDS + head[:, None] * width + (part * BLOCK_B + tl.arange(0, BLOCK_B))[None, :], s,
             mask=g_ok[:, None] & b_ok[None, :])
    peak = tl.max(s, axis=1)  # [G]; -inf for a program past its row's candidates (mass 0 then)
    tl.store(PEAK + head * pwidth + part, peak, mask=g_ok)
    finite_peak = tl.where(peak == float("-inf"), 0.0, peak)
    tl.store(MASS + head * pwidth + part, tl.sum(tl.exp(s - finite_peak[:, None]), axis=1), mask=g_ok)
    tl.debug_barrier()  # every thread's stores come before the release below
    finished = tl.atomic_add(COUNTER, 1, sem="acq_rel")  # the last to count sees every program's stores
    if finished == KV_HEADS * parts - 1:
        tl.store(COUNTER, 0)  # every program has counted: ready for the next launch
        kv = tl.arange(0, BLOCK_KV)[:, None, None]
        grp = tl.arange(0, BLOCK_G)[None, :, None]
        row = kv * GROUP + grp  # [KVH, G, 1] query head
        row_ok = (kv < KV_HEADS) & (grp < GROUP)
        # each query head's softmax max and sum over all n candidates, from the programs' partial ones
        offs_p = tl.arange(0, CHUNK_P)[None, None, :]
        m = tl.full([BLOCK_KV, BLOCK_G], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_KV, BLOCK_G], dtype=tl.float32)
        for start in range(0, parts, CHUNK_P):
            p_in = row_ok & (start + offs_p < pwidth)  # constant by 16: vectorised, the rows' tails masked below
            p_ok = start + offs_p < parts
            pk = tl.load(PEAK + row * pwidth + start + offs_p, mask=p_in, other=0.0, cache_modifier=".cg")
            pk = tl.where(p_ok, pk, float("-inf"))  # padding rows: max 0, sum > 0 (no inf - inf, no 1 / 0)
            ms = tl.load(MASS + row * pwidth + start + offs_p, mask=p_in, other=1.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(pk, axis=2))
            l = l * tl.exp(m - m_new) + tl.sum(tl.where(p_ok, ms, 0.0) * tl.exp(pk - m_new[:, :, None]), axis=2)
            m = m_new
        inv_l = 1.0 / l  # [KVH, G]

        offs = tl.arange(0, BLOCK_N)
        middle = (offs > 0) & (offs < n - 1)
        if CHUNK_N == BLOCK_N:  # every candidate in one tile: the scores stay in registers
            score = tl.where(middle, _chunk_scores(BOUNDS, width, row, row_ok, m, inv_l, 0, n, CHUNK_N), float("-inf"))
        else:
            for start in range(0, n, CHUNK_N):
                offs_c = start + tl.arange(0, CHUNK_N)
                tl.store(SCORES + offs_c, _chunk_scores(BOUNDS, width, row, row_ok, m, inv_l, start, n, CHUNK_N),
                         mask=offs_c < n)
            tl.debug_barrier()  # the program's threads read back what the others stored
            score = tl.where(middle, tl.load(SCORES + offs, mask=offs < width), float("-inf"))  # [BLOCK_N]
        tl.store(CHOSEN, tl.load(IDS))
        tl.store(CHOSEN + 1, tl.load(IDS + tl.maximum(n - 1, 0)))
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
    if not select_kernel_fits(q, n):
        return quest_select_reference(q, kmax, kmin, block_ids, scale, keep)
    return launch_select(q[None], kmax, kmin, block_ids[None], None, scale, keep)[0]


def select_kernel_fits(q: torch.Tensor, n: int) -> bool:
    """Does the select kernel take queries like q [.., H, D] over n candidate columns on q's device?"""
    dim = q.shape[-1]
    return use_triton(q.device) and dim == next_power_of_2(dim) and next_power_of_2(n) <= SELECT_MAX_CANDIDATES


def launch_select(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, ids: torch.Tensor,
                  num_valid: torch.Tensor | None, scale: float, keep: int) -> torch.Tensor:
    """The select kernel over rows: q [R, H, D], ids [R, N] (row r's candidates: its first num_valid[r], or all N
    when num_valid is None), keep <= N -> [R, keep] (ids' dtype), one launch of grid (KVH, cdiv(N, BLOCK_B), R).
    A row with fewer than keep + 1 candidates gets meaningless ids past its own (callers ignore them)."""
    q, kmax, kmin = _last_dim_contiguous(q, kmax, kmin)
    ids = ids if ids.stride(-1) == 1 else ids.contiguous()
    rows, heads, dim = q.shape
    n = ids.shape[1]
    kv_heads = kmax.shape[1]
    group = heads // kv_heads
    block_b, block_n = _block_b(), next_power_of_2(n)
    parts = cdiv(n, block_b)
    block_kv, block_g = next_power_of_2(kv_heads), max(2, next_power_of_2(group))
    chunk = max(2, (32 if triton_interpret() else SELECT_TILE) // (block_kv * block_g))  # small tiles: test chunking
    width, pwidth = cdiv(n, 16) * 16, cdiv(parts, 16) * 16  # the kernel's scratch rows (see the kernel)
    scratch = alloc_output((rows * ((heads + 1) * width + 2 * heads * pwidth),), torch.float32, q.device)
    chosen = torch.empty((rows, keep), dtype=ids.dtype, device=q.device)  # the kernel writes every entry
    _quest_select_kernel[(kv_heads, parts, rows)](
        q, kmax, kmin, ids, ids if num_valid is None else num_valid, scratch, _counter(q.device, rows), chosen,
        q.stride(0), q.stride(1), kmax.stride(0), kmax.stride(1), kmin.stride(0), kmin.stride(1), ids.stride(0),
        n, width, pwidth, float(scale), keep - 2,
        KV_HEADS=kv_heads, GROUP=group, BLOCK_KV=block_kv, BLOCK_G=block_g, HEAD_DIM=dim, BLOCK_B=block_b,
        BLOCK_N=block_n, CHUNK_N=min(chunk, block_n), CHUNK_P=min(chunk, next_power_of_2(parts)),
        HAS_COUNTS=num_valid is not None, num_warps=NUM_WARPS,
    )
    return chosen


def _counter(device: torch.device, rows: int = 1) -> torch.Tensor:
    """The device's int32 program counters, one per row, zeroed once: each select launch leaves them at 0. Made
    with room for COUNTER_ROWS rows, so that a launch inside a CUDA graph capture never allocates them."""
    counter = _COUNTERS.get(device)
    if counter is None or counter.numel() < rows:
        counter = _COUNTERS[device] = torch.zeros(max(rows, COUNTER_ROWS), dtype=torch.int32, device=device)
    return counter


def _block_b() -> int:
    return 8 if triton_interpret() else BLOCK_B


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
        GROUP=group, BLOCK_G=max(2, next_power_of_2(group)), HEAD_DIM=dim, BLOCK_B=_block_b(), num_warps=NUM_WARPS,
    )
    return out
