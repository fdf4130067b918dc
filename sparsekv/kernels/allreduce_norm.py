"""A tensor-parallel decode step's row-parallel linear layer, its all-reduce, residual add and next RMSNorm: one
launch after the GEMV.

    all_reduce_add_rms_norm(partials, bias, residual, norm_weight, eps, peers) -> (normed, new_residual)
        out          = sum over ranks r (in rank order) of sum over splits s (in split order) of partials_r[s]
                       + bias, rounded once to residual's dtype
        new_residual = out + residual                            (rounded, as add_rms_norm)
        normed       = rms_norm(new_residual, norm_weight, eps)

Every rank computes the same sum in the same order, so every rank holds bit-identical results. Where NCCL's
all-reduce ran, a decode step paid per row-parallel layer the GEMV's split-K reduction (or a separate norm), NCCL's
kernel (about 6 us inside a CUDA graph, and a launch that programmatic dependent launch cannot overlap) and the add +
norm kernel. Here one program per row sums its rank's fp32 split partials, writes them into its rank's slot of a
buffer every rank can read (torch symmetric memory over NVLink), raises a flag in each peer's buffer, waits for the
peers' flags, then reads every rank's row and finishes as sparsekv.kernels.linear_norm does.

Synchronisation (no host involvement, CUDA-graph safe): each row has a counter in local memory, advanced once per
call, which every rank advances in the same order (every rank runs the same steps). Call number c writes data slot
c % 2 and raises flag value c; a peer can be at most one call ahead (to pass call c + 1 it needs this rank's flag
c + 1), so the slot it writes next is never the one being read, and a flag still at c - 1 is the only value that
means "not yet". The waits spin on the GPU: as with NCCL, a rank that never arrives leaves its peers waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._dispatch import INTERPRET, alloc_output, jit, next_power_of_2, pdl_launch_options, pdl_wait, tl
from .linear_norm import add_norm_store
from .rmsnorm import KERNEL_DTYPES, MAX_ONE_PASS, add_rms_norm_reference, norm_warps

__all__ = ["MAX_ROWS", "PeerBuffers", "all_reduce_add_rms_norm", "all_reduce_add_rms_norm_reference",
           "buffer_bytes"]

MAX_ROWS = 16  # rows (decode sequences) per call: the skinny GEMV's limit
MAX_WIDTH = MAX_ONE_PASS  # hidden size: one program holds the row
COUNTER_WRAP = 1 << 30  # call numbers run 1 .. COUNTER_WRAP (even: the slots keep alternating across the wrap)
MAX_WORLD = 8


def buffer_bytes(world: int) -> int:
    """Bytes of one rank's exchange buffer: int32 flags [world, MAX_ROWS], then fp32 rows [2, MAX_ROWS, MAX_WIDTH]."""
    return 4 * (_flag_ints(world) + 2 * MAX_ROWS * MAX_WIDTH)


def _flag_ints(world: int) -> int:
    return -(-world * MAX_ROWS // 64) * 64  # the data starts 256-byte aligned


@dataclass(frozen=True)
class PeerBuffers:
    """One rank's view of the exchange: the base address of every rank's buffer (``buffer_bytes`` each, readable
    and writable from every rank's kernels), in rank order on this rank's device, and this rank's call counters."""
    pointers: torch.Tensor  # int64 [world], on the device
    counters: torch.Tensor  # int32 [MAX_ROWS], on the device, zero at start (flags and counters start equal)
    rank: int
    world: int
    storage: torch.Tensor | None = None  # what keeps this rank's buffer mapped (the symmetric-memory tensor)

    def __post_init__(self):
        if not 2 <= self.world <= MAX_WORLD or not 0 <= self.rank < self.world:
            raise ValueError(f"PeerBuffers: rank {self.rank} of world {self.world}; expected 0 <= rank < world and "
                             f"2 <= world <= {MAX_WORLD}")
        if self.pointers.shape != (self.world,) or self.pointers.dtype != torch.int64:
            raise ValueError(f"PeerBuffers.pointers must be int64 [world={self.world}]; got "
                             f"{self.pointers.dtype} {tuple(self.pointers.shape)}")
        if self.counters.shape != (MAX_ROWS,) or self.counters.dtype != torch.int32:
            raise ValueError(f"PeerBuffers.counters must be int32 [{MAX_ROWS}]; got "
                             f"{self.counters.dtype} {tuple(self.counters.shape)}")

    def fits(self, rows: int, width: int) -> bool:
        return 0 < rows <= MAX_ROWS and 0 < width <= MAX_WIDTH


@jit
def _peer(PTRS, r, dtype: tl.constexpr):
    return tl.load(PTRS + r).to(tl.pointer_type(dtype))


@jit
def _all_reduce_add_rms_norm_kernel(
    P, B, R, NW, OUT, RES_OUT, PTRS, COUNTERS,
    stride_r, stride_o, stride_ro,
    M, N, eps, rank,
    WORLD: tl.constexpr, FLAG_INTS: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr, WRAP: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    # P: this rank's fp32 partials [SPLIT_K, M, N]; PTRS: int64 [WORLD] buffer bases; row m from P[:, m]
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ok = offs < N
    w = tl.load(NW + offs, mask=ok, other=0.0).to(tl.float32)  # before the wait: no kernel writes the weights
    if HAS_BIAS:
        bias = tl.load(B + offs, mask=ok, other=0.0).to(tl.float32)
    previous = tl.load(COUNTERS + row)  # only this kernel writes the counters
    call = previous % WRAP + 1
    pdl_wait(USE_PDL)
    row64 = row.to(tl.int64)
    r = tl.load(R + row64 * stride_r + offs, mask=ok, other=0.0)
    local = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # split order, as the GEMV's split-K reduction
        local += tl.load(P + (s * M + row) * N + offs, mask=ok, other=0.0)
    data_row = FLAG_INTS + ((call % 2) * ROWS + row) * WIDTH  # int32 units = fp32 units
    mine = _peer(PTRS, rank, tl.float32)
    tl.store(mine + data_row + offs, local, mask=ok)
    tl.debug_barrier()  # every thread's store before the flag (the release below covers them)
    for other in tl.static_range(WORLD):
        if other != rank:
            tl.atomic_xchg(_peer(PTRS, other, tl.int32) + rank * ROWS + row, call, sem="release", scope="sys")
    my_flags = _peer(PTRS, rank, tl.int32)
    for other in tl.static_range(WORLD):
        if other != rank:
            while tl.atomic_add(my_flags + other * ROWS + row, 0, sem="acquire", scope="sys") == previous:
                pass
    tl.debug_barrier()
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for source in tl.static_range(WORLD):  # rank order: the same sum on every rank
        acc += tl.load(_peer(PTRS, source, tl.float32) + data_row + offs, mask=ok, other=0.0, cache_modifier=".cv")
    tl.store(COUNTERS + row, call)
    if HAS_BIAS:
        acc += bias
    add_norm_store(acc, r, w, OUT + row64 * stride_o, RES_OUT + row64 * stride_ro, offs, ok,
                   N, eps)


def all_reduce_add_rms_norm_reference(partials: list[torch.Tensor], bias: torch.Tensor | None,
                                      residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch over every rank's fp32 partials [S, M, N] (rank order): the sum in fp32 (+ bias), rounded once to
    residual's dtype, then add_rms_norm_reference -> (normed, new_residual)."""
    total = torch.zeros_like(partials[0][0])
    for rank_partials in partials:
        total += rank_partials.sum(0) if rank_partials.shape[0] > 1 else rank_partials[0]
    if bias is not None:
        total = total + bias.float()
    return add_rms_norm_reference(total.to(residual.dtype), residual, norm_weight, eps)


def _check(partials: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor,
           peers: PeerBuffers) -> None:
    name = "all_reduce_add_rms_norm"
    if partials.dim() != 3 or partials.dtype != torch.float32 or not partials.is_contiguous():
        raise ValueError(f"{name} expects contiguous fp32 partials [S, M, N] (skinny_linear_triton(..., "
                         f"partials=True)); got {partials.dtype} {tuple(partials.shape)}")
    _, m, n = partials.shape
    if residual.shape != (m, n) or residual.stride(-1) != 1 or residual.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}: residual must be [M={m}, N={n}] of {KERNEL_DTYPES}, unit stride along N; got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    if norm_weight.shape != (n,) or norm_weight.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}: norm_weight must be [N={n}]; got {norm_weight.dtype} {tuple(norm_weight.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{name}: bias must be [N={n}]; got {tuple(bias.shape)}")
    if not peers.fits(m, n):
        raise ValueError(f"{name}: M={m} rows of N={n} do not fit the exchange buffers (at most {MAX_ROWS} rows of "
                         f"{MAX_WIDTH}); use the all-reduce of the process group for larger shapes")
    devices = {t.device for t in (partials, residual, norm_weight, peers.pointers, peers.counters)}
    if len(devices) != 1 or (partials.device.type != "cuda" and not INTERPRET):
        raise ValueError(f"{name} expects every tensor on one CUDA device (or the CPU under TRITON_INTERPRET=1); "
                         f"got {sorted(map(str, devices))}")


def all_reduce_add_rms_norm(partials: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                            norm_weight: torch.Tensor, eps: float, peers: PeerBuffers, *, pdl: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fp32 partials [S, M, N], residual [M, N], norm_weight [N] -> (normed [M, N] in
    promote(residual, norm_weight) dtype, new_residual [M, N] in residual's dtype), summed over the ranks of
    ``peers``; see the module docstring. Every rank must make the same calls in the same order."""
    _check(partials, bias, residual, norm_weight, peers)
    splits, m, n = partials.shape
    normed = alloc_output((m, n), torch.promote_types(residual.dtype, norm_weight.dtype), residual.device)
    new_residual = alloc_output((m, n), residual.dtype, residual.device)
    block = next_power_of_2(n)
    _all_reduce_add_rms_norm_kernel[(m,)](
        partials, bias if bias is not None else partials, residual, norm_weight, normed, new_residual,
        peers.pointers, peers.counters,
        residual.stride(0), normed.stride(0), new_residual.stride(0),
        m, n, float(eps), peers.rank,
        WORLD=peers.world, FLAG_INTS=_flag_ints(peers.world), ROWS=MAX_ROWS, WIDTH=MAX_WIDTH, WRAP=COUNTER_WRAP,
        SPLIT_K=splits, HAS_BIAS=bias is not None,
        BLOCK_N=block, num_warps=norm_warps(block), **pdl_launch_options(pdl),
    )
    return normed, new_residual
