"""Attention of a few query rows (decode: Sq = 1) over contiguous K/V, flash-decoding style.

flash_attn_with_lse runs this for Sq <= attention.DECODE_MAX_SQ on the Triton path (decode_attention_triton), and
DecodePartials for the key sets of an offloaded decode step; q [Sq, H, D], k/v [Sk, KVH, D] give what
flash_attn_with_lse returns:
o [Sq, H, D] (q.dtype) and lse [H, Sq] fp32 natural log, -inf (and o = 0) for rows that see no key;
causal masking is bottom-right aligned (query i sees key j iff j <= i + Sk - Sq).

The prefill kernel gives each (block of 128 query rows, query head) one program that walks all keys: at
Sq = 1 that is H programs, each reading its kv head's K/V once per query head of the GQA group. Here phase 1
runs one program per (tile of query rows, kv head, split of the keys): the tile packs the Sq * GROUP query
rows of one kv head (row r is query r // GROUP of head kv_head * GROUP + r % GROUP), padded to >= 16 rows
for tl.dot, so each K/V tile is read once for the whole group; phase 2 merges the splits by log-sum-exp
(paged_attention.merge_splits). With a single split phase 1 writes the final result.
K/V may be any strided view (last dim contiguous), e.g. a run of GPU ring slots ``k_slots[a:b].flatten(0, 1)``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from ._dispatch import (INTERPRET, alloc_output, cdiv, choose_splits, default_kernels, exact_dot, jit,
                        next_power_of_2, tl)
from .attention import SUPPORTED_HEAD_DIMS, _empty_result, flash_attn_with_lse, online_softmax_step
from .attention_checks import check_qkv
from .merge import merge_attention_outputs
from .fp8_kv import check_fp8_kv, dequantize_kv
from .paged_attention import MIN_GROUP_ROWS, merge_splits

if TYPE_CHECKING:
    from .backend import KernelChoice

__all__ = ["DecodePartials", "choose_num_splits", "decode_attention_triton", "launch_plan"]

LOG2E = 1.4426950408889634

# Tuning constants (module globals read at each call, so tools/bench_kernels.py --decode can override them):
# starting values from the paged decode kernel; its H100 timings were launch-bound, too noisy to retune by.
BLOCK_N = 64  # keys per inner step on GPU (16-bit, D <= 128; shrunk for bigger rows)
KV_TILE_BYTES = 16384  # BLOCK_N * D * element_size of one K (or V) tile at most
NUM_WARPS = 4
NUM_STAGES = 3
INTERPRET_BLOCK_N = 32
MAX_TILE_ROWS = 64  # query rows (Sq * GROUP, padded) per program; more rows are spread over row tiles
MAX_TILE_ELEMS = 8192  # rows * D of the q tile (and of the fp32 accumulator) at most: 64 rows at D = 128
MIN_SPLIT_TOKENS = 128  # a split shorter than this costs more in merging than it saves
MAX_SPLITS = 128
PROGRAMS_PER_SM = 4  # target row_tiles * KVH * splits ~= PROGRAMS_PER_SM * num SMs


@jit
def _decode_split_kernel(
    Q, K, V, OP, LP,
    stride_qm, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_opm, stride_oph, stride_ops, stride_opd,
    stride_lpm, stride_lph, stride_lps,
    Sq, Sk, SK_PTR, qk_scale, split_len,
    KS, VS, stride_sb, scale_block,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, DIRECT: tl.constexpr, SK_ON_DEVICE: tl.constexpr,
    SCALED: tl.constexpr,
):
    row_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if SK_ON_DEVICE:  # the valid keys are a prefix of k/v whose length only the device knows (graph replays)
        Sk = tl.load(SK_PTR).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, Sk)

    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] packed (query, head of the group) rows
    row_ok = rows < Sq * GROUP
    qi = rows // GROUP  # [BLOCK_R] query index
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_R] query head
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    q = tl.load(Q + qi[:, None].to(tl.int64) * stride_qm + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)  # [BLOCK_R, D]
    first = (start + offs_n)[:, None].to(tl.int64)  # [BLOCK_N, 1]
    k_ptrs = K + kv_head.to(tl.int64) * stride_kh + first * stride_kn + offs_d[None, :] * stride_kd  # [BLOCK_N, D]
    v_ptrs = V + kv_head.to(tl.int64) * stride_vh + first * stride_vn + offs_d[None, :] * stride_vd
    last_key = qi + (Sk - Sq)  # [BLOCK_R] causal: the last key each row sees

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n  # [BLOCK_N]
        t_ok = tok < end
        k = tl.load(k_ptrs, mask=t_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptrs, mask=t_ok[:, None], other=0.0)  # [BLOCK_N, D]
        if SCALED:  # fp8 K/V, one scale per (block of scale_block keys, kv head): dequantized here, on load
            blk = (tok // scale_block).to(tl.int64) * stride_sb + kv_head
            k_scale = tl.load(KS + blk, mask=t_ok, other=0.0)  # [BLOCK_N]
            v_scale = tl.load(VS + blk, mask=t_ok, other=0.0)
            k = k.to(q.dtype)  # exact: fp8 fits in q's dtype; the scale goes on the scores
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            s = exact_dot(q, tl.trans(k), None) * (k_scale * qk_scale)[None, :]
        else:
            s = exact_dot(q, tl.trans(k), None) * qk_scale  # [BLOCK_R, BLOCK_N], log2 units
        if IS_CAUSAL:
            s = tl.where(t_ok[None, :] & (tok[None, :] <= last_key[:, None]), s, float("-inf"))
        else:
            s = tl.where(t_ok[None, :], s, float("-inf"))
        # non-causal rows always see tok[0] < end, so only causal rows can still have no key
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, IS_CAUSAL)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]  # [BLOCK_R, D]; 0 for rows that saw no key
    lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))  # log2 units
    if DIRECT:  # OP = o [Sq, H, D], LP = lse [H, Sq]: stride_lph is its H, stride_lpm its Sq stride
        tl.store(OP + qi[:, None] * stride_opm + heads[:, None] * stride_oph + offs_d[None, :] * stride_opd,
                 out.to(OP.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LP + heads * stride_lph + qi * stride_lpm, lse2 * 0.6931471805599453, mask=row_ok)
    else:  # OP = partial o [Sq, H, S, D] fp32, LP = partial lse [Sq, H, S] (log2 units)
        tl.store(OP + qi[:, None] * stride_opm + heads[:, None] * stride_oph + split * stride_ops
                 + offs_d[None, :] * stride_opd, out, mask=row_ok[:, None])
        tl.store(LP + qi * stride_lpm + heads * stride_lph + split * stride_lps, lse2, mask=row_ok)


def _tile_rows(rows: int, head_dim: int) -> int:
    """Query rows per program: all Sq * GROUP rows of a kv head when they fit, padded to >= 16 for tl.dot."""
    max_rows = max(MIN_GROUP_ROWS, min(MAX_TILE_ROWS, MAX_TILE_ELEMS // head_dim))
    return max(MIN_GROUP_ROWS, min(max_rows, next_power_of_2(rows)))


def choose_num_splits(row_tiles: int, kv_heads: int, seqlen_k: int, device: torch.device) -> int:
    """Splits of the keys per (row tile, kv head) so that the grid fills the GPU for long Sk."""
    return choose_splits(row_tiles * kv_heads, seqlen_k, device, min_split_tokens=MIN_SPLIT_TOKENS,
                         programs_per_sm=PROGRAMS_PER_SM, max_splits=MAX_SPLITS)


def launch_plan(sq: int, heads: int, kv_heads: int, seqlen_k: int, head_dim: int, element_size: int,
                device: torch.device, num_splits: int | None = None,
                max_splits: int | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_R, row tiles, splits, keys per split) of a call; splits start on BLOCK_N boundaries.
    ``num_splits`` replaces the heuristic; ``max_splits`` caps it."""
    block_n = (INTERPRET_BLOCK_N if INTERPRET
               else max(16, min(BLOCK_N, KV_TILE_BYTES // (head_dim * element_size))))
    # memoised (decode asks the same few questions every layer); the tuning globals are part of the key
    return _launch_plan(sq, heads, kv_heads, seqlen_k, head_dim, device, num_splits, max_splits, block_n,
                        MAX_TILE_ROWS, MAX_TILE_ELEMS, MIN_SPLIT_TOKENS, PROGRAMS_PER_SM, MAX_SPLITS)


@functools.lru_cache(maxsize=4096)
def _launch_plan(sq: int, heads: int, kv_heads: int, seqlen_k: int, head_dim: int, device: torch.device,
                 num_splits: int | None, max_splits: int | None, block_n: int,
                 *tuning: int) -> tuple[int, int, int, int, int]:
    rows = sq * (heads // kv_heads)
    block_r = _tile_rows(rows, head_dim)
    row_tiles = cdiv(rows, block_r)
    if num_splits is None:
        num_splits = choose_num_splits(row_tiles, kv_heads, seqlen_k, device)
    if max_splits is not None:
        num_splits = min(num_splits, max_splits)
    split_len = cdiv(cdiv(seqlen_k, max(1, int(num_splits))), block_n) * block_n
    return block_n, block_r, row_tiles, cdiv(seqlen_k, split_len), split_len


def _launch(q, k, v, out, out_strides, lse, lse_strides, scale: float, causal: bool, plan, direct: bool,
            length: torch.Tensor | None = None,
            scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Phase 1 over k/v with launch_plan's `plan`: out/lse are the final o/lse (direct) or split partials, with
    the (m, h, s, d) / (m, h, s) strides the kernel indexes them by. `length` (a device integer tensor, first
    element used) makes only the first `length` keys of k/v valid, read on the device. `scales` (k_scale, v_scale
    [nb, KVH] float32, same strides): k/v are fp8 blocks of Sk / nb keys, dequantized on load."""
    block_n, block_r, row_tiles, num_splits, split_len = plan
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    _decode_split_kernel[(row_tiles, KVH, num_splits)](
        q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out_strides, *lse_strides,
        Sq, Sk, q if length is None else length, scale * LOG2E, split_len,
        *((q, q, 0, 1) if scales is None else (*scales, scales[0].stride(0), Sk // scales[0].shape[0])),
        GROUP=H // KVH, BLOCK_R=block_r, HEAD_DIM=D, BLOCK_N=block_n, IS_CAUSAL=bool(causal), DIRECT=direct,
        SK_ON_DEVICE=length is not None, SCALED=scales is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                            num_splits: int | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel launch, unchecked: flash_attn_with_lse's Triton path calls this for small Sq after its checks.
    Needs Sq, Sk > 0 and D in SUPPORTED_HEAD_DIMS; ``num_splits`` overrides the split heuristic (tests, tuning);
    ``pdl``: the split merge launches with programmatic dependent launch."""
    Sq, H, D = q.shape
    Sk, KVH, _ = k.shape
    plan = launch_plan(Sq, H, KVH, Sk, D, q.element_size(), q.device, num_splits)
    num_splits = plan[3]
    o = alloc_output((Sq, H, D), q.dtype, q.device)  # [Sq, H, D]
    lse = alloc_output((H, Sq), torch.float32, q.device)  # [H, Sq]
    if num_splits == 1:
        _launch(q, k, v, o, (o.stride(0), o.stride(1), 0, o.stride(2)), lse, (lse.stride(1), lse.stride(0), 0),
                scale, causal, plan, direct=True)
        return o, lse
    o_part = alloc_output((Sq, H, num_splits, D), torch.float32, q.device)  # [Sq, H, S, D]
    lse_part = alloc_output((Sq, H, num_splits), torch.float32, q.device)  # [Sq, H, S] log2
    _launch(q, k, v, o_part, o_part.stride(), lse_part, lse_part.stride(), scale, causal, plan, direct=False)
    merge_splits(o_part, lse_part, o, lse, pdl=pdl)  # o [Sq, H, D] is its [B, H, D], lse [H, Sq] its [H, B]
    return o, lse


class DecodePartials:
    """Attention of one q [Sq, H, D] over several disjoint key sets (the ring groups of an offloaded decode step,
    then the sequence's unfinished block), merged once: each add() writes its flash-decoding splits into one
    shared buffer and finish() merges every split with a single reduce launch. Per key set that is one kernel
    launch instead of a split kernel, a reduce and a pairwise merge: offloaded decode is bound by host launch
    costs, so this is what keeps it at the PCIe floor.

    ``max_sets`` bounds the add() calls; each gets at most ``splits_per_set`` splits. Without Triton (the CPU
    reference path; ``kernels`` picks, default: the process default for q's device) the partials are merged
    pairwise by merge_attention_outputs.
    """

    def __init__(self, q: torch.Tensor, softmax_scale: float, max_sets: int, splits_per_set: int = 16, *,
                 kernels: KernelChoice | None = None):
        self.q, self.scale = q, float(softmax_scale)
        self.splits_per_set = splits_per_set
        self.count = 0
        self.kernels = kernels = kernels if kernels is not None else default_kernels(q.device)
        Sq, H, D = q.shape
        self.triton = kernels.triton and D in SUPPORTED_HEAD_DIMS and Sq > 0
        if self.triton:
            self.capacity = capacity = max(1, max_sets) * splits_per_set
            self.key = (q.device, _stream_id(q.device), Sq, H, D)
            parts = _WORKSPACES.pop(self.key, None)
            if parts is None or parts[1].shape[2] < capacity:
                if parts is not None:
                    _RETIRED.append(parts)  # a captured CUDA graph may still address them
                capacity = next_power_of_2(capacity)  # few sizes as the context grows
                parts = (torch.empty((Sq, H, capacity, D), dtype=torch.float32, device=q.device),  # [Sq, H, S, D]
                         torch.empty((Sq, H, capacity), dtype=torch.float32, device=q.device))  # [Sq, H, S] log2
            self.o_part, self.lse_part = parts
        else:
            self.out: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, k: torch.Tensor, v: torch.Tensor, causal: bool = False, length: torch.Tensor | None = None,
            scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Attend q to k/v [Sk, KVH, D] (bottom-right causal if asked) and keep the result for finish().
        `length` ([1] integer tensor on q's device, 1 <= length <= Sk): only the first `length` keys count, read
        by the kernel on the device (a captured decode step replays with a new length every token).
        `scales` (k_scale, v_scale [nb, KVH] float32): k/v are fp8 (sparsekv.kernels.fp8_kv), nb blocks of Sk / nb
        keys, key j of head h worth k[j, h] * k_scale[j // (Sk / nb), h]; dequantized on load."""
        if k.shape[0] == 0:
            return
        if scales is not None:
            if length is not None:
                raise ValueError("DecodePartials.add: fp8 k/v with scales take no length (whole blocks only)")
            check_fp8_kv(self.q, k, v, scales, caller="DecodePartials.add")
        if not self.triton:
            if scales is not None:  # the reference dequantizes explicitly
                k, v = (dequantize_kv(x, s, self.q.dtype) for x, s in zip((k, v), scales))
            if length is not None:  # the reference path: a host sync is fine here
                n = int(length.reshape(-1)[0])
                k, v = k[:n], v[:n]
            part = flash_attn_with_lse(self.q, k, v, self.scale, causal, kernels=self.kernels)
            self.out = part if self.out is None else merge_attention_outputs(*self.out, *part, kernels=self.kernels)
            return
        if scales is None:
            check_qkv(self.q, k, v)
        q = self.q
        Sq, H, D = q.shape
        plan = launch_plan(Sq, H, k.shape[1], k.shape[0], D, q.element_size(), q.device,
                           max_splits=self.splits_per_set)
        first, num_splits = self.count, plan[3]
        if first + num_splits > self.capacity:
            raise RuntimeError(f"DecodePartials holds {self.capacity} splits; raise max_sets")
        o_part = self.o_part[:, :, first:first + num_splits]
        lse_part = self.lse_part[:, :, first:first + num_splits]
        _launch(q, k, v, o_part, o_part.stride(), lse_part, lse_part.stride(), self.scale, causal, plan, direct=False,
                length=length, scales=scales)
        self.count = first + num_splits

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """o [Sq, H, D] (q.dtype), lse [H, Sq] fp32 of q over every key set added (o = 0, lse = -inf if none)."""
        if not self.triton:
            return self.out if self.out is not None else _empty_result(self.q)
        if self.count == 0:
            self._release()
            return _empty_result(self.q)
        Sq, H, D = self.q.shape
        o = alloc_output((Sq, H, D), self.q.dtype, self.q.device)
        lse = alloc_output((H, Sq), torch.float32, self.q.device)
        merge_splits(self.o_part[:, :, :self.count], self.lse_part[:, :, :self.count], o, lse,
                     pdl=self.kernels.pdl)
        self._release()  # the reduce is queued on this stream: the next user on it runs after the reduce read them
        return o, lse

    def _release(self) -> None:
        _WORKSPACES[self.key] = (self.o_part, self.lse_part)


# DecodePartials' split buffers, reused call after call (a decode step makes one per layer and sequence): keyed by
# device, stream and query shape, grown to the next power of two when a call needs more; a DecodePartials takes
# its buffers out while it is alive, so two never share them. A CUDA graph captured on its own stream gets buffers
# of its own (the stream is in the key) and replays use them in stream order; buffers outgrown are kept
# (_RETIRED, at most as many bytes as the live ones), never freed, since a captured graph may hold their address.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []


def _stream_id(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
