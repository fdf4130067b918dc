"""Launch configs of the skinny linear (sparsekv.kernels.gemv): the tuning tables and the choice of tiles and
split count for one problem.

CONFIGS maps M to (tensor cores?, BLOCK_N, BLOCK_K, num_warps, num_stages); the split count aims at
PROGRAMS_PER_SM programs per SM with each program streaming at least MIN_PROGRAM_BYTES of W. For M = 1,
SHAPE_CONFIGS first: rows for an exact weight shape (N, K), with an optional fixed split count, tensor cores allowed
(x padded to 16 rows, W pipelined through shared memory); shapes it does not list take CONFIGS' row. On the GEMV
(FMA) path num_stages > 1 asks Triton to software-pipeline the K loop (``tl.range(num_stages=...)``: cp.async
copies of W in flight, which a loop without tl.dot gets only when asked); 1 is the plain loop. These constants are
globals of this module read at each call (choose_config), so ``tools/bench_kernels.py --gemv`` and
``tools/tune_gemv_chain.py`` (whole decode chains replayed from a CUDA graph) override and sweep them here.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ._dispatch import cdiv, next_power_of_2, num_sms

__all__ = ["MAX_M", "GemvConfig", "choose_config", "shape_row", "split_length", "table_row"]

# ---------------------------------------------------------------------------------------------- tuning constants
MAX_M = 16  # rows up to which skinny_linear runs the kernel; more rows are a GEMM for cuBLAS
# Rows (max M, tensor cores, BLOCK_N, BLOCK_K, num_warps, num_stages): the first row with M <= max M applies.
# Timed on an H100 (`tools/bench_kernels.py --gemv --quick`): the sweep's best M = 1 config beat
# cuBLAS on every Qwen3-4B shape; it split K only for down_proj, so the split rule below (programs stream >= 128 KB)
# follows it. With it the whole batch-1 4K decode step took 5.32-5.35 ms against 5.43-5.57 with cuBLAS; batch 8
# gained nothing, hence KernelChoice.gemv_max_rows = 1 on CUDA. (ptxas, sm_90a, bf16: no spills.) At num_stages = 1 the
# GEMV (FMA) path is not software pipelined (no cp.async; > 1 asks for it: untimed), so its loads in
# flight come from occupancy: a [16, 256] tile is 4 16-byte loads per thread at 77 registers, ~6 programs (48 KB of
# loads) per SM; [16, 512] doubles the loads per program but takes 165 registers. The tensor-core path pipelines W and x
# through shared memory (cp.async): [32, 256] W + [16, 256] x tiles, 3 stages, 48 KB of shared memory, mma.sync.
CONFIGS = (
    (1, False, 16, 256, 4, 1),
    (MAX_M, True, 32, 256, 4, 3),
)
# M = 1 rows per weight shape, looked up before CONFIGS: (N, K, tensor cores, BLOCK_N, BLOCK_K, num_warps, num_stages,
# split_k or None for the heuristic). Shapes not listed take CONFIGS' M = 1 row. The rows are the last line of
# `python tools/tune_gemv_chain.py OUT_DIR --rounds 2` on an H100 (2026-11-23): the Qwen3-4B decode chain
# (36 layers + lm_head, 8.04 GB) replayed from a CUDA graph took 3.150 ms with CONFIGS alone and 2.854 ms with these
# rows under PDL (3.287 / 3.116 ms without PDL); lm_head's best was CONFIGS' row.
# The 8B rows: `tools/tune_gemv_chain.py OUT --model M --tp N --quick` on an H200 (2026-11-26), one rank's shards;
# chain under PDL, CONFIGS alone -> these rows: Qwen3-8B TP1 3.864 -> 3.706 ms, TP2 2.464 -> 2.015, TP4 1.571 ->
# 1.278; Llama-3.1-8B TP1 3.905 -> 3.660, TP2 2.579 -> 1.987. lm_head rows that gained < 0.1% are left out (CONFIGS).
# Shapes are exact (N, K), so one row serves every model and rank count that streams it (e.g. [6144, 4096] is the
# 8B models' TP1 qkv and Qwen3-8B's TP4 gate_up: the same best row).
SHAPE_CONFIGS: tuple = (
    # Qwen3-4B, TP1
    (6144, 2560, False, 8, 512, 2, 2, None),  # qkv
    (2560, 4096, False, 8, 512, 8, 1, 2),  # o_proj
    (19456, 2560, False, 8, 512, 4, 2, None),  # gate_up
    (2560, 9728, False, 32, 256, 4, 1, None),  # down (gated)
    # Qwen3-8B / Llama-3.1-8B, TP1
    (6144, 4096, False, 32, 256, 4, 1, None),  # qkv (also Qwen3-8B TP4 gate_up)
    (4096, 4096, False, 32, 512, 4, 1, None),  # o_proj
    (28672, 4096, False, 8, 256, 4, 1, None),  # Llama gate_up
    # TP2 shards
    (3072, 4096, False, 32, 512, 4, 1, None),  # qkv
    (4096, 2048, False, 8, 512, 4, 1, None),  # o_proj
    (4096, 6144, False, 32, 256, 4, 1, None),  # Qwen3-8B down
    (14336, 4096, False, 8, 512, 4, 1, None),  # Llama gate_up
    (4096, 7168, False, 32, 256, 4, 1, None),  # Llama down
    # TP4 shards (Qwen3-8B)
    (1536, 4096, False, 32, 512, 4, 1, 4),  # qkv
    (4096, 1024, False, 8, 256, 4, 1, 4),  # o_proj
    (4096, 3072, False, 8, 512, 4, 1, 4),  # down
)
PROGRAMS_PER_SM = 4  # split K until row blocks x splits >= PROGRAMS_PER_SM x SMs ...
MIN_PROGRAM_BYTES = 131072  # ... as long as each program still streams this much of W
MAX_SPLIT_K = 16
FMA_MAX_ACC = 8192  # elements (BLOCK_N * BLOCK_M * BLOCK_K) of the 3-d FMA accumulator: 64 fp32 regs at 4 warps
DOT_BLOCK_M = 16  # tl.dot needs >= 16 on each side


class GemvConfig(NamedTuple):
    """One launch: tile sizes, the code path, and SPLIT_K. ``block_m`` is 1 for the GEMV path, 16 with tl.dot."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    use_dot: bool = False
    block_m: int = 1

    def describe(self) -> str:
        return (f"{'dot' if self.use_dot else 'fma'} BN={self.block_n:<3d} BK={self.block_k:<4d} BM={self.block_m:<2d} "
                f"warps={self.num_warps} stages={self.num_stages} split={self.split_k:<2d}")


# ---------------------------------------------------------------------------------------------- choice
def table_row(m: int, configs=None) -> tuple[bool, int, int, int, int]:
    """(tensor cores, BLOCK_N, BLOCK_K, num_warps, num_stages) of CONFIGS (or `configs`) for M rows."""
    configs = CONFIGS if configs is None else configs
    for max_m, *row in configs:
        if m <= max_m:
            return tuple(row)
    return tuple(configs[-1][1:])


def shape_row(m: int, n: int, k: int, shape_configs=None) -> tuple[bool, int, int, int, int, int | None] | None:
    """(tensor cores, BLOCK_N, BLOCK_K, num_warps, num_stages, split_k or None) of SHAPE_CONFIGS (or
    `shape_configs`) for W [n, k] at m = 1; None where the shape has no row (or m > 1): CONFIGS applies."""
    shape_configs = SHAPE_CONFIGS if shape_configs is None else shape_configs
    if m != 1:
        return None
    for row in shape_configs:
        if len(row) != 8:
            raise ValueError(f"SHAPE_CONFIGS row {row!r} has {len(row)} fields; expected (N, K, tensor cores, "
                             f"BLOCK_N, BLOCK_K, num_warps, num_stages, split_k or None)")
        if row[0] == n and row[1] == k:
            return tuple(row[2:])
    return None


def choose_config(m: int, n: int, k: int, element_size: int, device: torch.device | str | None = None,
                  split_k: int | None = None) -> GemvConfig:
    """The launch for x [m, k] @ W [n, k]^T: SHAPE_CONFIGS' row for (n, k) at m = 1, else CONFIGS' row for m,
    tiles clamped to the problem, and the split count (``split_k`` overrides the row's and the heuristic's;
    either way it is cut so that no split is empty)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = num_sms(None)
    # memoised (a decode step asks the same few questions every layer); the tuning globals are part of the key
    configs = tuple(tuple(row) for row in CONFIGS)
    row = shape_row(m, n, k, tuple(tuple(r) for r in SHAPE_CONFIGS))
    return _choose_config(m, n, k, element_size, sms, split_k, configs, row, PROGRAMS_PER_SM, MIN_PROGRAM_BYTES,
                          MAX_SPLIT_K, FMA_MAX_ACC)


@functools.lru_cache(maxsize=4096)
def _choose_config(m: int, n: int, k: int, element_size: int, sms: int, split_k: int | None, configs, row,
                   programs_per_sm: int, min_program_bytes: int, max_split_k: int, fma_max_acc: int) -> GemvConfig:
    if row is not None:  # a SHAPE_CONFIGS row (m = 1): tensor cores allowed, x padded to 16 rows
        use_dot, block_n, block_k, warps, stages, row_split = row
        use_dot = bool(use_dot)
        split_k = row_split if split_k is None else split_k
    else:
        use_dot, block_n, block_k, warps, stages = table_row(m, configs)
        use_dot = bool(use_dot) and m > 1
    block_m = DOT_BLOCK_M if use_dot else next_power_of_2(m)
    low = 16 if use_dot else 1  # tl.dot's smallest side
    block_n = max(low, min(block_n, next_power_of_2(n)))
    block_k = max(16, min(block_k, next_power_of_2(k)))
    if not use_dot and block_m > 1:
        block_k = max(16, min(block_k, fma_max_acc // (block_n * block_m)))
    if split_k is None:
        row_blocks = cdiv(n, block_n)
        by_parallelism = cdiv(programs_per_sm * sms, row_blocks)
        by_bytes = (block_n * k * element_size) // max(1, min_program_bytes)
        split_k = max(1, min(by_parallelism, by_bytes, max_split_k))
    split_len = _aligned_split(k, max(1, int(split_k)), block_k)
    return GemvConfig(block_n, block_k, warps, stages, cdiv(k, split_len), use_dot, block_m)


def _aligned_split(k: int, split_k: int, block_k: int) -> int:
    return cdiv(cdiv(k, split_k), block_k) * block_k


def split_length(k: int, config: GemvConfig) -> int:
    """Elements of K per split: BLOCK_K-aligned, so only the last split can end mid-tile."""
    return _aligned_split(k, config.split_k, config.block_k)
