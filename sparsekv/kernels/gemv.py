"""Skinny linear: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) for the few rows of a decode step.

At M <= 16 rows a linear layer is a stream of its weight: 2 * M FLOPs per weight element, far below what the
tensor cores (or even the FMA units) can do per byte of HBM, so what counts is reading W once at full bandwidth.
cuBLAS runs these shapes at about 2.5 TB/s on an H100 that copies at about 3.0 TB/s; this kernel is built
only to stream W:

* each program owns BLOCK_N rows of W (output columns) and a range of K, loops over it in [BLOCK_N, BLOCK_K] tiles
  loaded coalesced along K (``evict_first``: W is read once) and multiplies them with the matching x tile
  [BLOCK_M, BLOCK_K] (L2-resident, every program reads it), accumulating in fp32:
  - M = 1 (a GEMV): FMAs into an fp32 [BLOCK_N, BLOCK_K] accumulator, reduced over K once at the end;
  - rows of CONFIGS marked ``dot``: ``tl.dot(w, x^T)`` on the tensor cores, x padded to BLOCK_M = 16 rows (the
    weight tile is the MMA's M side, the few tokens its N side);
  - other rows: FMAs into [BLOCK_N, BLOCK_M, BLOCK_K], reduced at the end (BLOCK_K shrunk to bound registers).
  Rows of W past N re-read row N - 1 (clamped) and are not stored, so W is loaded without masks unless K is
  ragged; x's padding rows past M are masked.
* split-K when N / BLOCK_N programs cannot fill the GPU (N = 2560 at K = 9728 is 160 programs of 16 rows): a
  second grid axis of SPLIT_K programs per row block, each over its own BLOCK_K-aligned range of K, writes fp32
  partials [SPLIT_K, M, N] and a small second kernel sums them in split order, adds the bias and casts. No
  atomics: the result is bit-identical run to run, and the launch is CUDA-graph safe (fixed-size allocations
  from the shapes, no host syncs).

Launch configs (tile sizes, the split count, the tuning tables) live in sparsekv.kernels.gemv_configs.
Semantics: fp32 products and accumulation, + bias in fp32, one rounding to x's dtype (what F.linear gives up to
summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import (
    HAS_TRITON,
    INTERPRET,
    alloc_output,
    cdiv,
    jit,
    pdl_launch_options,
    pdl_wait,
    tl,
)
from .activation import silu_and_mul_reference
from .gemv_configs import MAX_M, GemvConfig, choose_config, shape_row, split_length

__all__ = [
    "MAX_M",
    "GemvConfig",
    "choose_config",
    "shape_row",
    "silu_mul_linear",
    "silu_mul_linear_reference",
    "skinny_linear",
    "skinny_linear_reference",
]

REDUCE_BLOCK = 1024  # outputs per program of the split-K reduction
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------- reference
def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N] in fp32, rounded once to x's dtype -> [M, N]."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------- kernels
@jit
def _load_w(w_ptrs, k0, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # one [BLOCK_N, BLOCK_K] tile of W, read once (evict_first); columns past k_end read as 0
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        k_ok = (k0 + tl.arange(0, BLOCK_K)) < k_end
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
    return w


@jit
def _load_x(x_ptrs, mask, K, GATED: tl.constexpr):
    # a tile of x (L2-resident: every program reads it); mask None = unmasked. GATED: x_ptrs point into
    # gate_up [M, 2K] and x = silu(gate) * up, rounded like silu_and_mul (silu to x's dtype, then the product)
    if mask is None:
        x = tl.load(x_ptrs, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    if GATED:
        if mask is None:
            u = tl.load(x_ptrs + K, eviction_policy="evict_last")
        else:
            u = tl.load(x_ptrs + K, mask=mask, other=0.0, eviction_policy="evict_last")
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
        x = (act * u.to(tl.float32)).to(x.dtype)
    return x


@jit
def _gemv_tile(acc2, w_ptrs, x_ptrs, k0, k_end, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr):
    # acc2 [BLOCK_N, BLOCK_K] fp32 += the W tile at w_ptrs times the x tile at x_ptrs (columns k0 ...)
    w = _load_w(w_ptrs, k0, k_end, BLOCK_K, EVEN_K)
    x = _load_x(x_ptrs, None if EVEN_K else (k0 + tl.arange(0, BLOCK_K)) < k_end, K, GATED)
    return acc2 + w.to(tl.float32) * x.to(tl.float32)[None, :]


@jit
def _skinny_linear_kernel(
    X, W, B, OUT,
    stride_xm, stride_wn, stride_om, stride_on, stride_os,
    M, N, K, split_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, GATED: tl.constexpr, FMA_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
):
    # X [M, K] (GATED: gate_up [M, 2K]), W [N, K], both unit stride along K; OUT is out [M, N] or, with PARTIAL,
    # partials [SPLIT_K, M, N]
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    rows_n = tl.where(n_ok, offs_n, N - 1).to(tl.int64)  # rows past N re-read row N - 1 and are not stored
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_ok = offs_m < M  # x's padding rows are masked (no traffic), their outputs not stored
    k_start = split * split_len
    k_end = tl.minimum(k_start + split_len, K)
    offs_k = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    w_ptrs = W + rows_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]

    if BLOCK_M == 1:  # GEMV: x is one row
        # the first W tile streams in before the wait on the previous kernel (with PDL: under its tail); every
        # program has at least one tile (no split is empty). Then the loop from the second tile on.
        w = _load_w(w_ptrs, k_start, k_end, BLOCK_K, EVEN_K)
        pdl_wait(USE_PDL)
        x_ptrs = X + offs_k  # [BLOCK_K]
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        x = _load_x(x_ptrs, None if EVEN_K else offs_k < k_end, K, GATED)
        acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        if FMA_STAGES > 1:  # cp.async pipelining: Triton pipelines a loop without tl.dot only when asked to
            for k0 in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=FMA_STAGES):
                acc2 = _gemv_tile(acc2, w_ptrs, x_ptrs, k0, k_end, K, BLOCK_K, EVEN_K, GATED)
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
        else:
            for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
                acc2 = _gemv_tile(acc2, w_ptrs, x_ptrs, k0, k_end, K, BLOCK_K, EVEN_K, GATED)
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]
    else:
        pdl_wait(USE_PDL)
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        if USE_DOT:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc3 = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            w = _load_w(w_ptrs, k0, k_end, BLOCK_K, EVEN_K)  # [BLOCK_N, BLOCK_K]
            if EVEN_K:
                x = _load_x(x_ptrs, m_ok[:, None], K, GATED)  # [BLOCK_M, BLOCK_K]
            else:
                k_ok = (k0 + tl.arange(0, BLOCK_K)) < k_end
                x = _load_x(x_ptrs, m_ok[:, None] & k_ok[None, :], K, GATED)
            if USE_DOT:
                if DOT_F32:  # fp32 inputs (exact products: no tf32), or bf16 under the interpreter
                    acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, tl.trans(x), acc)  # [BLOCK_N, BLOCK_M]
            else:
                acc3 += w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if not USE_DOT:
            acc = tl.sum(acc3, axis=2)  # [BLOCK_N, BLOCK_M]

    out_ptrs = OUT + split * stride_os + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on  # [BN, BM]
    ok = n_ok[:, None] & m_ok[None, :]
    if PARTIAL:
        tl.store(out_ptrs, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(B + rows_n).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=ok)


@jit
def _splitk_reduce_kernel(P, B, OUT, MN, N, SPLIT_K, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    # P partials [SPLIT_K, M, N] fp32 contiguous, OUT [M, N] contiguous: summed in split order (deterministic)
    pdl_wait(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat (m, n)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):  # a runtime count: one compiled reduction for every split count
        acc += tl.load(P + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)



# ---------------------------------------------------------------------------------------------- launchers
def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False) -> None:
    name, x_name, factor, cols = ("silu_mul_linear", "gate_up", 2, "2K") if gated else ("skinny_linear", "x", 1, "K")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{name} expects {x_name} [M, {cols}] and weight [N, K]; got {x_name} {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)} (flatten leading dims first: reshape(-1, {x_name}.shape[-1]))")
    if x.shape[1] != factor * weight.shape[1]:
        raise ValueError(f"{name}: {x_name} {tuple(x.shape)} has {cols}={x.shape[1]} but weight "
                         f"{tuple(weight.shape)} has K={weight.shape[1]}; weight must be [out_features, in_features] "
                         f"like nn.Linear's")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"{name} expects bias [N={weight.shape[0]}]; got {tuple(bias.shape)}")
    # cheap comparisons first (a decode step checks every layer); the message is built only on failure
    same_device = x.device == weight.device and (bias is None or bias.device == x.device)
    same_dtype = x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype) and x.dtype.is_floating_point
    if not (same_device and same_dtype):
        tensors = {x_name: x, "weight": weight, **({"bias": bias} if bias is not None else {})}
        if not same_device:
            raise ValueError(f"{name} expects every tensor on one device; got "
                             + ", ".join(f"{key} on {t.device}" for key, t in tensors.items()))
        raise ValueError(f"{name} expects {x_name}, weight (and bias) of one floating dtype; got "
                         + ", ".join(f"{key} {t.dtype}" for key, t in tensors.items())
                         + " (cast the activations to the weight's dtype)")


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    m, k = x.shape
    return HAS_TRITON and 0 < m <= MAX_M and k > 0 and weight.shape[0] > 0 and x.dtype in KERNEL_DTYPES


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: GemvConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation.

    The Triton kernel for 1 <= M <= MAX_M and fp32/fp16/bf16 (``pdl``: launched with programmatic dependent
    launch); otherwise ``F.linear``. ``config`` replaces :func:`choose_config` (tests, tuning).
    """
    _check(x, weight, bias)
    if not _kernel_applies(x, weight):
        return F.linear(x, weight, bias)
    return skinny_linear_triton(x, weight, bias, config, pdl=pdl)


def silu_mul_linear_reference(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """silu_and_mul(gate_up [M, 2K]) (rounded to its dtype) @ weight [N, K]^T + bias, fp32 accumulation -> [M, N]."""
    return skinny_linear_reference(silu_and_mul_reference(gate_up), weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    config: GemvConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """A gated MLP's down projection: silu(gate) * up of gate_up [M, 2K] (gate first) @ weight [N, K]^T -> [M, N].

    The skinny kernel computes silu(gate) * up while it loads x (rounded as :func:`silu_and_mul` rounds), so the
    [M, K] activation is never written; where the kernel does not apply, ``F.linear`` of the reference
    silu_and_mul.
    """
    _check(gate_up, weight, bias, gated=True)
    if not _kernel_applies(gate_up, weight):
        return F.linear(silu_and_mul_reference(gate_up), weight, bias)
    return skinny_linear_triton(gate_up, weight, bias, config, gated=True, pdl=pdl)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: GemvConfig | None = None, gated: bool = False, partials: bool = False,
                         pdl: bool = False) -> torch.Tensor:
    """The launch, unchecked: x [M, K] (gated: gate_up [M, 2K]), weight [N, K] of one kernel dtype on one device,
    1 <= M <= 16, N, K > 0. With ``partials`` the fp32 per-split sums [SPLIT_K, M, N] (no bias), for a consumer
    that reduces them itself (sparsekv.kernels.linear_norm), even when SPLIT_K is 1."""
    m = x.shape[0]
    n, k = weight.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()  # a copy per call: nn.Linear weights are contiguous
    if config is None:
        config = choose_config(m, n, k, x.element_size(), x.device)
    if config.block_m < m:
        raise ValueError(f"skinny_linear: config {config.describe()} holds {config.block_m} rows; x has M={m}")
    split_len = split_length(k, config)
    splits = cdiv(k, split_len)
    partial = splits > 1 or partials
    out = None if partials else alloc_output((m, n), x.dtype, x.device)  # [M, N]
    has_bias = bias is not None and not partials
    dest = alloc_output((splits, m, n), torch.float32, x.device) if partial else out  # [S, M, N] fp32 partials
    dot_f32 = config.use_dot and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and INTERPRET))
    launch = pdl_launch_options(pdl)
    _skinny_linear_kernel[(cdiv(n, config.block_n), splits)](
        x, weight, bias if has_bias else x, dest,
        x.stride(0), weight.stride(0), dest.stride(-2), dest.stride(-1), dest.stride(0) if partial else 0,
        m, n, k, split_len,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_DOT=config.use_dot,
        DOT_F32=dot_f32, EVEN_K=k % config.block_k == 0, HAS_BIAS=has_bias, PARTIAL=partial, GATED=gated,
        FMA_STAGES=config.num_stages if config.block_m == 1 and not config.use_dot else 1,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch,
    )
    if partials:
        return dest
    if partial:
        _splitk_reduce_kernel[(cdiv(m * n, REDUCE_BLOCK),)](
            dest, bias if has_bias else dest, out, m * n, n, SPLIT_K=splits, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK,
            num_warps=4, **launch)
    return out
