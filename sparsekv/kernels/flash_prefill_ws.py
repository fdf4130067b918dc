"""Warp-specialized dense prefill attention for Hopper (Triton's automatic warp specialization on sm_90).

The same contract as attention._flash_fwd_kernel (o [Sq, H, D], lse [H, Sq], bottom-right causal alignment, rows
that see no key give o = 0 and lse = -inf), in the shape Triton 3.6's Hopper warp specializer accepts: one key
loop marked ``warp_specialize=True``. With num_warps = 4 and BLOCK_M = 128 the pass makes one producer warp group
that issues the K/V TMA loads and two consumer warp groups of 64 query rows each, synchronised by mbarriers instead
of the CTA-wide barriers that keep the two warp groups of _flash_fwd_kernel in lockstep. What the pass needs (found
by compiling for sm_90 with Triton 3.6): a single key loop with no branch inside it (a second loop or an ``if``
makes it fail or silently give up), so the mask is applied on every key block (one compare and select per score;
non-causal calls only where Sk is not a multiple of BLOCK_N); Q read through a device-side descriptor, which the
pass can split per consumer (a host-side one keeps its BLOCK_M-row TMA box); o and lse written with plain stores.
A persistent form (one program per SM walking the tiles heaviest first) warp-specializes its tile loop instead,
which also accepts one plain key loop inside.
"""

from __future__ import annotations

import torch

from ._dispatch import INTERPRET, cdiv, exact_dot, jit, tl
from .tma import TensorDescriptor, ensure_device_descriptor_allocator, use_tma

__all__ = ["launch_flash_fwd_ws", "ws_supported"]


@jit
def tile_coords(tile, num_m_blocks, num_heads, IS_CAUSAL: tl.constexpr):
    """(row block, head) of tile number `tile` in heavy-first order: the heads of one row block are neighbours (GQA
    groups share K/V tiles in L2) and, for causal, the row blocks that see the most keys come first (the short
    ones then fill the last wave)."""
    head = tile % num_heads
    pid_m = tile // num_heads
    if IS_CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m
    return pid_m, head


@jit
def program_tile(num_m_blocks, num_heads, IS_CAUSAL: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """(row block, head) of this program: HEAVY_FIRST, a 1-D grid in tile_coords order; else the 2-D grid (row
    block, head)."""
    if HEAVY_FIRST:
        pid_m, head = tile_coords(tl.program_id(0), num_m_blocks, num_heads, IS_CAUSAL)
    else:
        pid_m = tl.program_id(0)
        head = tl.program_id(1)
    return pid_m, head


@jit
def _ws_tile(
    q_desc, K, V, O, LSE, stride_om, stride_oh, stride_lh, stride_lm, Sq, Sk, qk_scale, pid_m, head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, EVEN_K: tl.constexpr, LOOP_WS: tl.constexpr,
):
    # One (row block, head) tile; q_desc: [Sq, H * D] device-side descriptor; K/V: [Sk, KVH * D] descriptors.
    start_m = pid_m * BLOCK_M
    kv_col = (head // GROUP) * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    q = q_desc.load([start_m, head * HEAD_DIM])  # [BLOCK_M, D]; rows >= Sq read as zero

    causal_off = Sk - Sq
    if IS_CAUSAL:
        hi = tl.maximum(tl.minimum(Sk, start_m + BLOCK_M + causal_off), 0)
    else:
        hi = Sk

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=LOOP_WS):
        k = K.load([start_n, kv_col])  # [BLOCK_N, D]; rows >= Sk read as zero
        s = exact_dot(q, tl.trans(k), None)  # [BLOCK_M, BLOCK_N] raw scores
        if IS_CAUSAL:  # also hides keys >= Sk from the rows < Sq (the only rows stored)
            s = tl.where(offs_n[None, :] <= (offs_m + (causal_off - start_n))[:, None], s, float("-inf"))
        elif not EVEN_K:
            s = tl.where(offs_n[None, :] < Sk - start_n, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # A row that sees any key sees key 0 (in the first block), so only rows that see none keep -inf here: shift
        # them by 0 so that exp2 gives 0, not NaN.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        v = V.load([start_n, kv_col])
        acc = exact_dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row_ok = offs_m < Sq
    o_ptrs = O + head.to(tl.int64) * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + head.to(tl.int64) * stride_lh + offs_m * stride_lm, lse, mask=row_ok)


@jit
def _flash_fwd_ws_kernel(
    Q, K, V, O, LSE,
    stride_qm, stride_om, stride_oh, stride_lh, stride_lm,
    Sq, Sk, qk_scale, num_heads,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HEAVY_FIRST: tl.constexpr, PERSISTENT: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, EVEN_K: tl.constexpr,
):
    # Q: [Sq, H * D] base pointer (row stride stride_qm); K/V: [Sk, KVH * D] TMA descriptors; qk_scale > 0.
    # PERSISTENT: each program walks tiles pid, pid + programs, ... in tile_coords order, and the tile loop is the
    # warp-specialized one (the producer then also prefetches the next tile's K/V during this tile's epilogue).
    q_desc = tl.make_tensor_descriptor(Q, shape=[Sq, num_heads * HEAD_DIM], strides=[stride_qm, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    num_m = tl.cdiv(Sq, BLOCK_M)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_m * num_heads, tl.num_programs(0),
                             warp_specialize=WARP_SPECIALIZE):
            pid_m, head = tile_coords(tile, num_m, num_heads, IS_CAUSAL)
            _ws_tile(q_desc, K, V, O, LSE, stride_om, stride_oh, stride_lh, stride_lm, Sq, Sk, qk_scale, pid_m, head,
                     GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL, EVEN_K, False)
    else:
        pid_m, head = program_tile(num_m, num_heads, IS_CAUSAL, HEAVY_FIRST)
        _ws_tile(q_desc, K, V, O, LSE, stride_om, stride_oh, stride_lh, stride_lm, Sq, Sk, qk_scale, pid_m, head,
                 GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL, EVEN_K, WARP_SPECIALIZE)


def ws_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, scale: float) -> bool:
    """Whether launch_flash_fwd_ws can run this call: a positive scale, TMA-compatible K/V (tma.use_tma), q and o
    with heads * D contiguous rows, and on a GPU 16-bit inputs on sm_90 (the pass is Hopper's; the interpreter runs
    any dtype)."""
    if scale <= 0 or not use_tma(q, k, v, o) or q.stride(1) != q.shape[2] or o.stride(1) != o.shape[2]:
        return False
    if INTERPRET:
        return True
    return q.element_size() == 2 and torch.cuda.get_device_capability(q.device)[0] == 9


def launch_flash_fwd_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                        qk_scale: float, causal: bool, config: tuple[int, int, int, int],
                        heavy_first: bool = True, persistent: bool = False) -> None:
    """Run _flash_fwd_ws_kernel into o [Sq, H, D] and lse [H, Sq] (check ws_supported first). qk_scale: the
    softmax scale times log2(e); config = (BLOCK_M, BLOCK_N, num_warps, num_stages), num_warps = 4 for the
    warp-specialized form (the pass adds the producer warp group and splits BLOCK_M over two consumers).
    persistent: one program per SM (3 under the interpreter) walking the tiles heavy-first."""
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    block_m, block_n, warps, stages = config
    ka, va = (TensorDescriptor(t, [Sk, KVH * D], [t.stride(0), 1], [block_n, D]) for t in (k, v))
    ensure_device_descriptor_allocator()
    num_m = cdiv(Sq, block_m)
    if persistent:
        sms = 3 if INTERPRET else torch.cuda.get_device_properties(q.device).multi_processor_count
        grid = (min(num_m * H, sms),)
    else:
        grid = (num_m * H,) if heavy_first else (num_m, H)
    _flash_fwd_ws_kernel[grid](
        q, ka, va, o, lse, q.stride(0), o.stride(0), o.stride(1), *lse.stride(), Sq, Sk, qk_scale, H,
        GROUP=H // KVH, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=causal, HEAVY_FIRST=heavy_first,
        PERSISTENT=persistent, WARP_SPECIALIZE=not INTERPRET, EVEN_K=Sk % block_n == 0,
        num_warps=warps, num_stages=stages,
    )
