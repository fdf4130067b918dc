"""Block-sparse flash attention that also returns the log-sum-exp of each row.

block_sparse_attention(q [n, H, D], k/v [S, KVH, D], block_idx [nqb, W], block_count [nqb], block_size,
                       softmax_scale, q_start) -> (o [n, H, D], lse [H, n] fp32)

Positions are absolute: query row i sits at position q_start + i (default q_start = S - n, the last n positions),
key j at position j. Blocks are `block_size` tokens from position 0; query block qb0 + r (qb0 = q_start //
block_size, r < nqb = ceil((q_start + n) / block_size) - qb0) attends to the key blocks block_idx[r, :block_count[r]]
(one list shared by every head), causally: key j is seen by query p iff j <= p and j < S. So the query block's own
(diagonal) block is masked causally and a listed block after it contributes nothing. Rows that see no key give
o = 0 and lse = -inf, so partial results merge exactly with merge_attention_outputs.

List conventions: block_idx is int32 (any integer dtype is accepted), each row sorted ascending without duplicates,
entries in [0, ceil(S / block_size)); entries past block_count[r] are padding and never read. block_lists_from_mask
builds (block_idx, block_count) from a boolean [nqb, nkb] selection on the device, without a host sync.

Triton kernel, one program per (BLOCK_M query rows inside one query block, head), online softmax in two phases:
  1. the listed blocks before the query block, BLOCK_N keys at a time: every key visible to every row, no mask;
  2. the query block's own (diagonal) block, if listed: causal mask, keys past the rows' last position or past S
     skipped.
Each key tile is the dense kernel's step (attention._attn_block_step: the same tiles, fused exp2 scaling and TMA
loads of K/V where they run). Phase 1 walks the blocks one of two ways (LoopConfig.mode; the lead A/Bs them with
tools/tune_xattn.py):
  runs:  the listed blocks as runs of consecutive blocks (block_lists.block_runs, built on the device), walked by
         one flat loop whose key advances by BLOCK_N and jumps to the next run's start at a run's end (the run table
         is read only there). The key chain needs no load inside a run, so Triton's pipeliner keeps K/V
         num_stages - 1 tiles ahead as in the dense kernel's loop; at density 1.0 it is the dense loop. A loop over
         runs around a loop over each run's tiles would pipeline each run separately, and ptxas serialized every
         wgmma of that kernel (C7515);
  lists: one loop over every listed tile, each tile's key read from the list. The pipeliner splits the loop's
         num_stages - 1 between the list read and the K/V loads that depend on it: at the kernel's 3 stages K/V
         were one tile ahead, not two (the kernel before runs: 1.2x the dense kernel per tile on an H100), so this
         loop gets 2 * num_stages - 1 stages (5: K/V two tiles ahead in 3 buffers, the list entry four ahead);
  auto:  per query block, runs where they average at least run_min_tiles tiles, else lists.
Checked by compiling for sm_90 with Triton 3.6 without a GPU (a finished investigation, in git history): K/V buffers, no
wgmma serialization, loop bodies within 25 SASS instructions of the dense kernel's 489. BLOCK_M and BLOCK_N divide
block_size; head dims outside attention.SUPPORTED_HEAD_DIMS, or a block_size without a power-of-two divisor >= 16,
run the reference.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from sparsekv.kernels._dispatch import HAS_TRITON, alloc_output, cdiv, jit, tl, use_triton
from sparsekv.kernels.attention import (
    SUPPORTED_HEAD_DIMS,
    _attn_block_step,
    _empty_result,
    dense_tile_config,
    effective_attn_variants,
    masked_attention_rows,
)
from sparsekv.kernels.attention_checks import check_qkv
from sparsekv.kernels.tma import TensorDescriptor
from .block_lists import BlockRuns, block_lists_from_mask, block_mask_from_lists, block_runs

__all__ = ["LoopConfig", "block_lists_from_mask", "block_sparse_attention", "block_sparse_attention_reference",
           "block_sparse_attention_runs", "loop_config"]

LOG2E = 1.4426950408889634

# Tiles: attention.py's dense-kernel configs (timed there; sm_90 16-bit D=128: 128x128, 8 warps, 3 stages), with
# BLOCK_M and BLOCK_N cut to divide block_size. Of the dense kernel's compile-time variants (ATTN_VARIANTS) the two
# that apply per tile are used where they can run (effective_attn_variants): the scale fused into exp2, and K/V
# through TMA descriptors (sm_90+).
VARIANTS: dict[str, bool] = {"FUSED_SCALE": True, "USE_TMA": True}
REFERENCE_CHUNK_ELEMENTS = 1 << 24  # [H, rows, S] scores the reference materialises at once
LOOP_MODES = {"lists": 0, "runs": 1, "auto": 2}


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How phase 1 walks the listed blocks (module docstring). list_stages 0: 2 * num_stages - 1, the list loop's
    K/V loads as far ahead as the dense loop's (Triton's pipeliner gives each of its two load levels half of the
    loop's num_stages - 1); list_stages 3 at sm_90's 3 stages is the kernel before runs."""
    mode: str = "auto"
    run_min_tiles: int = 4
    list_stages: int = 0

    def __post_init__(self) -> None:
        if self.mode not in LOOP_MODES:
            raise ValueError(f"LoopConfig.mode={self.mode!r}: must be one of {sorted(LOOP_MODES)}")
        for name in ("run_min_tiles", "list_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"LoopConfig.{name}={getattr(self, name)!r}: must be an integer >= 0")


LOOP = LoopConfig()


def loop_config(spec: str) -> LoopConfig:
    """LOOP updated by a "key=value,..." spec, e.g. "mode=lists,list_stages=3" (the kernel before runs)."""
    fields = [f.name for f in dataclasses.fields(LoopConfig)]
    updates: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in fields:
            raise ValueError(f"loop spec item {item!r}: expected key=value with key in {sorted(fields)}")
        if key != "mode" and not value.isdigit():
            raise ValueError(f"loop spec item {item!r}: {key} must be a non-negative integer")
        updates[key] = value if key == "mode" else int(value)
    return dataclasses.replace(LOOP, **updates)


# ----------------------------------------------------------------------------------------- Triton kernel
@jit
def _key_tile(acc, m_i, l_i, q, k_src, v_src, kv_col, start_n, pos, offs_n, S, qk_scale, stride_kn, stride_vn,
              MASKED: tl.constexpr, FUSED_SCALE: tl.constexpr, USE_TMA: tl.constexpr):
    # The dense kernel's step at key start_n (causal against absolute positions pos). k_src/v_src: the K/V
    # descriptors (USE_TMA), or [BLOCK_N, D] pointer blocks at key 0.
    if USE_TMA:
        k_tile = k_src
        v_tile = v_src
    else:
        key = tl.cast(start_n, tl.int64)  # a plain int under the interpreter
        k_tile = k_src + key * stride_kn
        v_tile = v_src + key * stride_vn
    return _attn_block_step(acc, m_i, l_i, q, k_tile, v_tile, kv_col, start_n, pos, offs_n, S, 0, qk_scale,
                            MASKED, True, FUSED_SCALE, USE_TMA)


@jit
def _bsa_fwd_kernel(
    Q, K, V, O, LSE, IDX, RUN_LO, RUN_HI, NFULL, NRUNS, DIAG,
    stride_qm, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_om, stride_oh, stride_od,
    stride_lh, stride_lm, stride_ir,
    n, S, q_start, p_first, qk_scale,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    FUSED_SCALE: tl.constexpr, USE_TMA: tl.constexpr,
    LOOP_MODE: tl.constexpr, RUN_MIN_TILES: tl.constexpr, LIST_STAGES: tl.constexpr,
):
    # TILES = BLOCK_SIZE // BLOCK_N key tiles per block. With USE_TMA, K and V are TMA descriptors of [S, KVH * D]
    # views (q and o always move through pointers: the first query block may start before q_start).
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    first = p_first + pid_m * BLOCK_M  # absolute position of the program's first row
    pos = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] absolute query positions
    row_ok = (pos >= q_start) & (pos < q_start + n)
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    rows = (pos - q_start).to(tl.int64)  # rows of q / o

    q = tl.load(Q + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    kv_col = kv_head * HEAD_DIM
    k_src = K
    v_src = V
    if not USE_TMA:
        k_src = K + kv_head.to(tl.int64) * stride_kh + offs_n[:, None].to(tl.int64) * stride_kn \
            + offs_d[None, :] * stride_kd  # [BLOCK_N, D] pointers at key 0
        v_src = V + kv_head.to(tl.int64) * stride_vh + offs_n[:, None].to(tl.int64) * stride_vn \
            + offs_d[None, :] * stride_vd

    # this program's rows all lie in one query block (BLOCK_M divides BLOCK_SIZE): its row of the lists
    qb_row = (pid_m * BLOCK_M) // BLOCK_SIZE
    has_rows = (first + BLOCK_M > q_start) & (first < q_start + n)
    n_full = tl.where(has_rows, tl.load(NFULL + qb_row), 0)
    n_runs = tl.where(has_rows, tl.load(NRUNS + qb_row), 0)
    diag = tl.where(has_rows, tl.load(DIAG + qb_row), 0)
    row_off = qb_row.to(tl.int64) * stride_ir
    tiles = n_full * TILES  # key tiles before the diagonal block
    run_tiles = tiles if LOOP_MODE == 1 else 0
    list_tiles = tiles if LOOP_MODE == 0 else 0
    if LOOP_MODE == 2:  # auto: runs where they are long, else the list
        use_runs = n_runs * RUN_MIN_TILES <= tiles
        run_tiles = tl.where(use_runs, tiles, 0)
        list_tiles = tl.where(use_runs, 0, tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # ---- 1a. the runs of blocks before the query block, no mask. One flat loop over their tiles whose key advances
    # by BLOCK_N and jumps to the next run's start at a run's end (the run table is read only there); the pipeliner
    # computes this chain num_stages - 1 tiles ahead. (A loop over runs around a loop over a run's tiles made ptxas
    # serialize every wgmma of the kernel, C7515.)
    if LOOP_MODE != 0:
        r = 0
        key = tl.load(RUN_LO + row_off) * BLOCK_SIZE  # the table has at least one column
        end = tl.load(RUN_HI + row_off) * BLOCK_SIZE
        last_run = tl.maximum(n_runs - 1, 0)
        for _ in tl.range(0, run_tiles):
            acc, m_i, l_i = _key_tile(acc, m_i, l_i, q, k_src, v_src, kv_col, key, pos, offs_n, S, qk_scale,
                                      stride_kn, stride_vn, False, FUSED_SCALE, USE_TMA)
            key += BLOCK_N
            at_end = key >= end
            r = tl.where(at_end, tl.minimum(r + 1, last_run), r)
            key = tl.where(at_end, tl.load(RUN_LO + row_off + r, mask=at_end, other=0) * BLOCK_SIZE, key)
            end = tl.where(at_end, tl.load(RUN_HI + row_off + r, mask=at_end, other=0) * BLOCK_SIZE, end)

    # ---- 1b. the same blocks tile by tile from the list, no mask
    if LOOP_MODE != 1:
        for it in tl.range(0, list_tiles, num_stages=LIST_STAGES):
            start_n = tl.load(IDX + row_off + it // TILES) * BLOCK_SIZE + (it % TILES) * BLOCK_N
            acc, m_i, l_i = _key_tile(acc, m_i, l_i, q, k_src, v_src, kv_col, start_n, pos, offs_n, S, qk_scale,
                                      stride_kn, stride_vn, False, FUSED_SCALE, USE_TMA)

    # ---- 2. the diagonal block: causal mask, keys < S, tiles past the program's last row skipped. Its first tile
    # starts at or before every row's position, so no row meets a wholly masked tile first.
    lo = p_first + qb_row * BLOCK_SIZE
    hi = tl.minimum(tl.minimum(lo + BLOCK_SIZE, tl.minimum(first + BLOCK_M, q_start + n)), S)
    hi = tl.where(diag != 0, hi, lo)
    for start_n in tl.range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _key_tile(acc, m_i, l_i, q, k_src, v_src, kv_col, start_n, pos, offs_n, S, qk_scale,
                                  stride_kn, stride_vn, True, FUSED_SCALE, USE_TMA)

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_ptrs = O + head.to(tl.int64) * stride_oh + rows[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + head.to(tl.int64) * stride_lh + rows * stride_lm, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------- validation
def _layout(n: int, S: int, block_size: int, q_start: int) -> tuple[int, int]:
    """(qb0, nqb): the first query block and the number of query blocks."""
    qb0 = q_start // block_size
    return qb0, cdiv(q_start + n, block_size) - qb0


def _check_inputs(q, k, v, block_idx, block_count, block_size, q_start) -> int:
    """Validate; returns q_start (default S - n)."""
    check_qkv(q, k, v)
    n, S = q.shape[0], k.shape[0]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: must be an integer >= 1")
    if q_start is None:
        q_start = S - n
    if isinstance(q_start, bool) or not isinstance(q_start, int) or q_start < 0 or q_start + n > S:
        raise ValueError(f"q_start={q_start!r}: must be an int in [0, S - n] = [0, {S - n}] "
                         f"(q {tuple(q.shape)} sits inside k {tuple(k.shape)})")
    _, nqb = _layout(n, S, block_size, q_start)
    for name, t, dims in (("block_idx", block_idx, 2), ("block_count", block_count, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[0] != nqb:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            want = "[nqb, W]" if dims == 2 else "[nqb]"
            raise ValueError(f"expected {name} of shape {want} with nqb={nqb} query blocks of {block_size} tokens "
                             f"(q_start={q_start}, n={n}); got {shape}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers (int32), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return q_start


# -------------------------------------------------------------------------------------------- reference
def block_sparse_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, block_count: torch.Tensor,
    block_size: int, softmax_scale: float | None = None, q_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch fp32 reference: the dense (query, key) mask of the listed blocks, built over blocks of query rows
    so that at most REFERENCE_CHUNK_ELEMENTS scores exist at once. Returns o [n, H, D] (q.dtype), lse [H, n]."""
    q_start = _check_inputs(q, k, v, block_idx, block_count, block_size, q_start)
    n, H, D = q.shape
    S, KVH, _ = k.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if n == 0 or S == 0:
        return _empty_result(q)
    qb0, _ = _layout(n, S, block_size, q_start)
    blocks = block_mask_from_lists(block_idx, block_count, cdiv(S, block_size))  # [nqb, nkb]
    kf = k.float().transpose(0, 1).repeat_interleave(H // KVH, dim=0)  # [H, S, D]
    vf = v.float().transpose(0, 1).repeat_interleave(H // KVH, dim=0)  # [H, S, D]
    keys = torch.arange(S, device=q.device)
    rows = max(1, REFERENCE_CHUNK_ELEMENTS // max(1, H * S))
    o = torch.empty((n, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, n), dtype=torch.float32, device=q.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        pos = q_start + torch.arange(r0, r1, device=q.device)  # [r]
        mask = blocks[pos // block_size - qb0][:, keys // block_size] & (keys[None, :] <= pos[:, None])  # [r, S]
        part_o, lse[:, r0:r1] = masked_attention_rows(q[r0:r1], kf, vf, mask[None], scale)
        o[r0:r1] = part_o.to(q.dtype)
    return o, lse


# ------------------------------------------------------------------------------------------- launcher
def _config(q: torch.Tensor, block_size: int) -> tuple[int, int, int, int] | None:
    """Tile config (the dense kernel's for this dtype, head dim and GPU, cut to divide block_size), or None where
    the kernel does not apply (the reference runs)."""
    D = q.shape[2]
    if D not in SUPPORTED_HEAD_DIMS:
        return None
    block_m, block_n, warps, stages = dense_tile_config(q)
    divisor = block_size & -block_size  # the largest power of two dividing block_size
    block_m, block_n = min(block_m, divisor), min(block_n, divisor)
    if block_n < 16:
        return None
    return block_m, block_n, warps, stages


def _block_sparse_triton(q, k, v, runs: BlockRuns, block_size, scale, q_start, config, loop: LoopConfig):
    n, H, D = q.shape
    S, KVH, _ = k.shape
    block_m, block_n, warps, stages = config
    qb0, nqb = _layout(n, S, block_size, q_start)
    o = alloc_output((n, H, D), q.dtype, q.device)  # [n, H, D]
    lse = alloc_output((H, n), torch.float32, q.device)  # [H, n]
    flags = effective_attn_variants(q, k, v, o, scale, VARIANTS)
    ka, va = k, v
    if flags["USE_TMA"]:
        ka, va = (TensorDescriptor(t, [S, KVH * D], [t.stride(0), 1], [block_n, D]) for t in (k, v))
    _bsa_fwd_kernel[(cdiv(nqb * block_size, block_m), H)](
        q, ka, va, o, lse, runs.idx, runs.lo, runs.hi, runs.n_full, runs.n_runs, runs.diag,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(), runs.idx.stride(0),
        n, S, q_start, qb0 * block_size, scale * LOG2E,
        GROUP=H // KVH, BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        TILES=block_size // block_n, FUSED_SCALE=flags["FUSED_SCALE"], USE_TMA=flags["USE_TMA"],
        LOOP_MODE=LOOP_MODES[loop.mode], RUN_MIN_TILES=loop.run_min_tiles,
        LIST_STAGES=loop.list_stages or 2 * stages - 1,
        num_warps=warps, num_stages=stages,
    )
    return o, lse


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, block_count: torch.Tensor,
    block_size: int, softmax_scale: float | None = None, q_start: int | None = None, loop: LoopConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query blocks to their listed key blocks (see the module docstring).

    q [n, H, D] at positions q_start.. (default S - n), k/v [S, KVH, D], block_idx [nqb, W] sorted key blocks per
    query block, block_count [nqb] -> (o [n, H, D] in q.dtype, lse [H, n] fp32 natural log). Runs the Triton
    kernel on CUDA (or on CPU under TRITON_INTERPRET=1), else the reference. No host sync. loop: how the kernel
    walks the blocks (default: LOOP, whose mode "auto" picks runs or lists from the selection on the device).
    """
    q_start = _check_inputs(q, k, v, block_idx, block_count, block_size, q_start)
    runs = block_runs(block_idx, block_count, q_start // block_size)  # device ops: no host sync
    return block_sparse_attention_runs(q, k, v, runs, block_size, softmax_scale, q_start, loop)


def block_sparse_attention_runs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: BlockRuns, block_size: int,
    softmax_scale: float | None = None, q_start: int | None = None, loop: LoopConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_sparse_attention with the selection already as the kernel reads it: `runs`, block_lists.block_runs'
    of the lists (block_select.select_block_runs builds it from the masses in two launches). A query block attends
    to the first n_full + diag entries of its list: the blocks before it and its own."""
    q_start = _check_inputs(q, k, v, runs.idx, runs.n_full, block_size, q_start)
    n, _, D = q.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if n == 0 or k.shape[0] == 0 or D == 0:
        return _empty_result(q)
    config = _config(q, block_size) if HAS_TRITON and use_triton(q.device) else None
    if config is None:
        return block_sparse_attention_reference(q, k, v, runs.idx, runs.n_full + runs.diag, block_size, scale,
                                                q_start)
    return _block_sparse_triton(q, k, v, runs, block_size, scale, q_start, config, loop if loop is not None else LOOP)
