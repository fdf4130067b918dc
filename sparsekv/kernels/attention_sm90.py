"""Dense prefill attention for Hopper (sm_90) in Gluon, Triton's explicit layer: FlashAttention-3's structure.

flash_attn_sm90(q [Sq, H, D], k/v [Sk, KVH, D], scale, causal) -> (o [Sq, H, D], lse [H, Sq] fp32), the same
contract as sparsekv.kernels.attention.flash_attn_with_lse (bottom-right causal alignment; rows that see no key
give o = 0, lse = -inf); flash_attn_with_lse_reference is its reference.

One program per (128 query rows, head), three warp-specialized partitions sharing shared memory:
- a loader warp group (24 registers) issues the TMA loads of Q and of each K/V block into a ring of STAGES slots
  (each load completes an mbarrier), and waits for both consumers to release a slot before refilling it;
- two consumer warp groups (240 registers) of 64 query rows each. In its turn a consumer issues the scores of the
  next block (S = Q K^T) and the P V product of this one back to back as asynchronous wgmmas, passes the turn to the
  other, then runs the softmax of the next block while the other consumer's matrix products run (the "ping-pong"),
  and rescales its accumulator once its P V is done.
A row keeps a stale running max until its true max exceeds it by more than RESCALE_THRESHOLD (log2 units; then
p <= 2^8, safe in fp32 sums and 16-bit P), FlashAttention-4's conditional rescaling: alpha stays exactly 1 and a warp
whose rows all keep theirs skips the accumulator's rescale (64 multiplies a thread) by a warp vote in inline PTX.
Deciding for the whole warp group instead needs a cross-warp reduction with two bar.syncs per block: 7% slower than
rescaling every block, where the warp vote is 2-3% faster (docs/decisions.md).
Turns and slot releases go through the SM's named hardware barriers (bar.sync / bar.arrive, IDs from
NAMED_BARRIER_BASE), not mbarriers: Gluon puts a warp-group-wide bar.sync before every mbarrier arrive and between
mbarrier waits (six per key block with turns and releases on mbarriers, one now), and on a GPU held at its power
limit every instruction costs clock (128K causal 624-633 -> 639-642 TFLOP/s, docs/decisions.md). Only the TMA loads
complete mbarriers.
Chosen where it applies (sm_90, 16-bit q/k/v, D = 128, TMA-compatible layouts; see sm90_attention_ok); timed
against the Triton kernel by tools/tune_prefill_attention.py (docs/decisions.md, "Prefill attention"). Gluon has no
CPU interpreter: the kernel is tested on the GPU against the reference (tests/kernels/test_attention_sm90.py).
"""
from __future__ import annotations

import torch

from .tma import tma_view_ok

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    import inspect

    # Triton 3.6 names the TMA copies async_copy_*; later versions async_load / async_store
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    HAS_GLUON = "functions_and_args" in inspect.signature(gl.warp_specialize).parameters
except (ImportError, AttributeError):  # pragma: no cover - triton without Gluon's Hopper layer
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "flash_attn_sm90", "sm90_attention_ok"]

HEAD_DIM = 128
BLOCK_M = 128  # query rows per program: two consumer warp groups of 64
BLOCK_N = 128  # keys per block (64 keys with 3 or 4 slots: 14-18% slower, docs/decisions.md)
STAGES = 2  # K/V ring slots (3: the same at 32K causal, 1.5% slower at 128K, 3% on a 4Kx32K chunk)
# Named barriers (16 per CTA): Triton's warp_specialize takes IDs 0-3 for its partitions; the K slots' releases use
# NAMED_BARRIER_BASE + slot, the V slots' NAMED_BARRIER_BASE + STAGES + slot
NAMED_BARRIER_BASE = 4
TURN_BARRIER = 14  # consumer warp group w waits for its turn at TURN_BARRIER + w
LOG2E = 1.4426950408889634
RESCALE_THRESHOLD = 8.0  # how far (log2 units) a row's max may outgrow its stale one before the row rescales


def rescale_ptx(n: int) -> tuple[str, str]:
    """(asm, constraints) of acc *= alpha over a thread's n accumulator elements, skipped by a warp whose rows all
    have alpha 1. Operands: $0..$n-1 the results, tied to the accumulator's registers ($n..$2n-1), so a skip leaves
    them as they are; $2n..$3n-1 alpha per element. In wgmma's accumulator layout a thread's elements 0 and 2 lie in
    its two rows (r and r + 8), so their alphas decide."""
    muls = " ".join(f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n))
    asm = (f"{{ .reg .pred r0, r1; setp.neu.f32 r0, ${2 * n}, 0f3F800000; setp.neu.f32 r1, ${2 * n + 2}, 0f3F800000; "
           f"or.pred r0, r0, r1; vote.sync.any.pred r0, r0, 0xffffffff; @!r0 bra SKIP_RESCALE${{:uid}}; {muls} "
           f"SKIP_RESCALE${{:uid}}: }}")
    constraints = ",".join(["=r"] * n + [str(i) for i in range(n)] + ["r"] * n)
    return asm, constraints


def sm90_attention_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether flash_attn_sm90 serves this call: Gluon present, an sm_90 device, 16-bit q/k/v of one dtype,
    head dim 128, TMA-compatible layouts, and rows for more than the decode kernel's few queries."""
    return (HAS_GLUON and q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == q.dtype and v.dtype == q.dtype and q.shape[2] == HEAD_DIM
            and torch.cuda.get_device_capability(q.device) == (9, 0)
            and all(tma_view_ok(t) for t in (q, k, v)))


if HAS_GLUON:
    _NAMED_BASE = gl.constexpr(NAMED_BARRIER_BASE)
    _TURN = gl.constexpr(TURN_BARRIER)
    _RESCALE_PACK = gl.constexpr(BLOCK_M // 2 * HEAD_DIM // 128)  # a consumer's [64, D] fp32 accumulator / thread
    _RESCALE_ASM, _RESCALE_CONSTRAINTS = (gl.constexpr(x) for x in rescale_ptx(_RESCALE_PACK.value))
    _THRESHOLD = gl.constexpr(RESCALE_THRESHOLD)

    @gluon.jit
    def _named_sync(bar_id, THREADS: gl.constexpr):
        # wait at hardware barrier bar_id until THREADS threads (this warp group's included) have reached it
        gl.inline_asm_elementwise(f"bar.sync $1, {THREADS}; mov.u32 $0, 0;", "=r,r", [bar_id], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _named_arrive(bar_id, THREADS: gl.constexpr):
        # count this warp group at hardware barrier bar_id without waiting. Each warp counts as it gets here, so
        # after warpgroup_mma_wait it tells that the wgmma is done: one wgmma serves all four warps
        gl.inline_asm_elementwise(f"bar.arrive $1, {THREADS}; mov.u32 $0, 0;", "=r,r", [bar_id], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _softmax_block(s, m_i, l_i, start_n, offs_m, cols, Sk, causal_off, qk_scale, MASKED: gl.constexpr,
                       FIRST: gl.constexpr):
        # s [ROWS, BLOCK_N] raw scores; m_i, l_i [ROWS] (running max in log2 units, row sum) -> p, alpha, m, l.
        # After the first block m_i is finite: a row that saw no key there sees none later (causal) and holds 0
        if MASKED:
            keys = gl.expand_dims(start_n + cols, 0)  # [1, BLOCK_N]
            keep = (keys < Sk) & (keys <= gl.expand_dims(offs_m, 1) + causal_off)
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        if FIRST:
            if MASKED:
                m_new = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key: exp2 gives 0, not NaN
        else:
            m_new = gl.where(m_new > m_i + _THRESHOLD, m_new, m_i)  # the stale max, unless it fell too far behind
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, o_desc, LSE, stride_lh, Sq,
                  Sk, qk_scale, start_m, head, n_blocks, causal_off):
        # Constants come from the shapes: values passed through warp_specialize arrive as tensors.
        SLOTS: gl.constexpr = k_smem.shape[0]
        BN: gl.constexpr = k_smem.shape[1]
        D: gl.constexpr = k_smem.shape[2]
        ROWS: gl.constexpr = q_smem.shape[1]
        K_FREE: gl.constexpr = _NAMED_BASE  # + slot: both consumers and the loader, 3 x 128 threads
        V_FREE: gl.constexpr = _NAMED_BASE + SLOTS
        MY_TURN: gl.constexpr = _TURN + WG  # both consumers, 2 x 128 threads
        OTHER_TURN: gl.constexpr = _TURN + 1 - WG
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        my_q = q_smem.index(WG)  # [ROWS, D]
        row0 = start_m + WG * ROWS
        n_full = gl.maximum(gl.minimum(Sk, row0 + causal_off + 1), 0) // BN  # blocks every row sees whole
        offs_m = row0 + gl.arange(0, ROWS, layout=row_s)  # [ROWS]
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))  # [BN]
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
        acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)  # [ROWS, D]
        s_zero = gl.zeros([ROWS, BN], gl.float32, layout=s_layout)
        # Every bar.sync must meet its arrivals and none may be left over: a slot is released only for a block
        # that will refill it (block b + SLOTS < n_blocks), and warp group 1 starts the turns (warp group 0 goes
        # first) but passes none after its last.
        if WG == 1:
            if n_blocks > 0:
                _named_arrive(OTHER_TURN, 256)
        mbarrier.wait(q_ready.index(0), 0)
        if n_blocks > 0:
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma(my_q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            if SLOTS < n_blocks:
                _named_arrive(K_FREE, 384)
            if n_full > 0:
                p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, 0, offs_m, cols, Sk, causal_off, qk_scale, False,
                                                    True)
            else:
                p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, 0, offs_m, cols, Sk, causal_off, qk_scale, True,
                                                    True)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(0, n_blocks - 1):
                slot = j % SLOTS
                nslot = (j + 1) % SLOTS
                mbarrier.wait(k_ready.index(nslot), ((j + 1) // SLOTS) & 1)
                mbarrier.wait(v_ready.index(slot), (j // SLOTS) & 1)
                _named_sync(MY_TURN, 256)
                s_next = warpgroup_mma(my_q, k_smem.index(nslot).permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                acc = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
                _named_arrive(OTHER_TURN, 256)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))  # P V of block j may still run
                if j + 1 + SLOTS < n_blocks:
                    _named_arrive(K_FREE + nslot, 384)
                if j + 1 >= n_full:
                    p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, (j + 1) * BN, offs_m, cols, Sk, causal_off,
                                                        qk_scale, True, False)
                else:
                    p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, (j + 1) * BN, offs_m, cols, Sk, causal_off,
                                                        qk_scale, False, False)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                if j + SLOTS < n_blocks:
                    _named_arrive(V_FREE + slot, 384)
                alpha_b, acc = gl.broadcast(gl.expand_dims(gl.convert_layout(alpha, row_o), 1), acc)  # [ROWS, D]
                acc = gl.inline_asm_elementwise(_RESCALE_ASM, _RESCALE_CONSTRAINTS, [acc, alpha_b], dtype=gl.float32,
                                                is_pure=True, pack=_RESCALE_PACK)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            last = n_blocks - 1
            slot = last % SLOTS
            mbarrier.wait(v_ready.index(slot), (last // SLOTS) & 1)
            _named_sync(MY_TURN, 256)
            acc = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
            if WG == 0:
                _named_arrive(OTHER_TURN, 256)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        has_keys = l_i > 0.0
        l_safe = gl.where(has_keys, l_i, 1.0)
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
        lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        my_q.store(out.to(dtype))  # Q's tile is free: every score product is done
        fence_async_shared()
        _tma_store(o_desc, [row0, head * D], my_q)  # rows >= Sq are not written
        gl.store(LSE + head * stride_lh + offs_m, lse, mask=offs_m < Sq)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _consumer0(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, q_desc, k_desc, v_desc, o_desc, LSE, stride_lh,
                   Sq, Sk, qk_scale, start_m, head, kv_col, n_blocks, causal_off):
        _consumer(0, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, o_desc, LSE, stride_lh, Sq, Sk, qk_scale,
                  start_m, head, n_blocks, causal_off)

    @gluon.jit
    def _consumer1(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, q_desc, k_desc, v_desc, o_desc, LSE, stride_lh,
                   Sq, Sk, qk_scale, start_m, head, kv_col, n_blocks, causal_off):
        _consumer(1, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, o_desc, LSE, stride_lh, Sq, Sk, qk_scale,
                  start_m, head, n_blocks, causal_off)

    @gluon.jit
    def _loader(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, q_desc, k_desc, v_desc, o_desc, LSE, stride_lh,
                Sq, Sk, qk_scale, start_m, head, kv_col, n_blocks, causal_off):
        SLOTS: gl.constexpr = k_smem.shape[0]
        BN: gl.constexpr = k_smem.shape[1]
        D: gl.constexpr = k_smem.shape[2]
        ROWS: gl.constexpr = q_smem.shape[1]
        K_FREE: gl.constexpr = _NAMED_BASE  # + slot, as in _consumer
        V_FREE: gl.constexpr = _NAMED_BASE + SLOTS
        kv_bytes: gl.constexpr = BN * D * 2
        mbarrier.expect(q_ready.index(0), 2 * ROWS * D * 2)
        _tma_load(q_desc, [start_m, head * D], q_ready.index(0), q_smem.index(0))  # rows >= Sq read as zero
        _tma_load(q_desc, [start_m + ROWS, head * D], q_ready.index(0), q_smem.index(1))
        for b in range(0, n_blocks):
            slot = b % SLOTS
            if b >= SLOTS:  # both consumers are done with block b - SLOTS's K
                _named_sync(K_FREE + slot, 384)
            mbarrier.expect(k_ready.index(slot), kv_bytes)
            _tma_load(k_desc, [b * BN, kv_col], k_ready.index(slot), k_smem.index(slot))
            if b >= SLOTS:  # and with its V
                _named_sync(V_FREE + slot, 384)
            mbarrier.expect(v_ready.index(slot), kv_bytes)
            _tma_load(v_desc, [b * BN, kv_col], v_ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _flash_fwd_sm90_kernel(q_desc, k_desc, v_desc, o_desc, LSE, stride_lh, Sq, Sk, qk_scale,
                               GROUP: gl.constexpr, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                               SLOTS: gl.constexpr, IS_CAUSAL: gl.constexpr):
        # q/k/v/o: descriptors of [S, heads * D] views; LSE [H, Sq] fp32
        # the heaviest query blocks first (causal: the last rows see the most keys), so that the lightest fill the
        # last wave (32K causal 612 -> 618-626 TFLOP/s, 128K 565 -> 605)
        start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BM
        head = gl.program_id(1)
        kv_col = (head // GROUP) * D
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, BM // 2, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [SLOTS, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [SLOTS, BN, D], v_desc.layout)
        # one allocation per role: Gluon orders accesses to one allocation with warp-group barriers
        q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready.index(0), count=1)
        for i in gl.static_range(SLOTS):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
        if IS_CAUSAL:
            causal_off = Sk - Sq  # key j is visible to query i iff j <= i + causal_off
            hi = gl.maximum(gl.minimum(Sk, start_m + BM + causal_off), 0)
        else:
            causal_off = Sk + 0 * Sq  # every key
            hi = Sk
        n_blocks = gl.cdiv(hi, BN)
        args = (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, q_desc, k_desc, v_desc, o_desc, LSE, stride_lh, Sq,
                Sk, qk_scale, start_m, head, kv_col, n_blocks, causal_off)
        gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args)], [4, 4], [240, 24])


def kernel_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, scale: float,
                  causal: bool) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, arguments, constexprs) of _flash_fwd_sm90_kernel for checked tensors: the launch, and the record pass
    of compile_ahead, which specializes it without a GPU."""
    Sq, H, D = q.shape
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def desc(t: torch.Tensor, rows: int):  # [S, heads, D] as [S, heads * D], tiles of [rows, D]
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gdt)
        return GluonDescriptor(t, [t.shape[0], t.shape[1] * D], [t.stride(0), 1], [rows, D], layout)

    args = (desc(q, BLOCK_M // 2), desc(k, BLOCK_N), desc(v, BLOCK_N), desc(o, BLOCK_M // 2), lse, lse.stride(0), Sq,
            k.shape[0], scale * LOG2E)
    constants = dict(GROUP=H // k.shape[1], D=D, BM=BLOCK_M, BN=BLOCK_N, SLOTS=STAGES, IS_CAUSAL=causal, num_warps=4)
    return (-(-Sq // BLOCK_M), H), args, constants


def flash_attn_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Sq, H, D], k/v [Sk, KVH, D] -> (o [Sq, H, D] in q's dtype, lse [H, Sq] fp32); ``out``: (o, lse) to
    write into. Needs sm90_attention_ok(q, k, v) and scale > 0."""
    if not sm90_attention_ok(q, k, v):
        raise ValueError(f"flash_attn_sm90 needs Gluon, an sm_90 GPU, 16-bit q/k/v of one dtype, head dim "
                         f"{HEAD_DIM} and TMA-compatible layouts; got q {q.dtype} {tuple(q.shape)} on {q.device}, "
                         f"k {k.dtype} {tuple(k.shape)}, v {v.dtype} {tuple(v.shape)}: use flash_attn_with_lse")
    Sq, H, _ = q.shape
    KVH = k.shape[1]
    if H % KVH or v.shape != k.shape or not scale > 0:
        raise ValueError(f"flash_attn_sm90: H={H} must be a multiple of KVH={KVH}, v {tuple(v.shape)} must match "
                         f"k {tuple(k.shape)} and scale={scale} must be positive")
    o, lse = out if out is not None else (torch.empty_like(q, memory_format=torch.contiguous_format),
                                          torch.empty((H, Sq), dtype=torch.float32, device=q.device))
    if o.shape != q.shape or o.dtype != q.dtype or not tma_view_ok(o) or lse.shape != (H, Sq) or lse.stride(1) != 1:
        raise ValueError(f"flash_attn_sm90: out must be o {tuple(q.shape)} {q.dtype} (heads and D contiguous) and "
                         f"lse [{H}, {Sq}] fp32 with unit stride along Sq")
    grid, args, constants = kernel_launch(q, k, v, o, lse, scale, causal)
    _flash_fwd_sm90_kernel[grid](*args, **constants)
    return o, lse
