"""Does programmatic dependent launch (PDL) shorten a chain of skinny GEMVs replayed from one CUDA graph?

A decode step is ~145 dependent one-row GEMVs (Qwen3-4B: qkv, o, gate_up, down per layer). Each kernel's ramp-up
and tail leave HBM idle; with PDL the next kernel is scheduled while the previous one drains and can stream its
first weight tile (weights never depend on the previous kernel) before `gdc_wait` releases it to read x.

    python3 scripts/probe_pdl.py [--layers 36] [--replays 50]

Prints ms per chain and GB/s over the weight bytes, with and without PDL, and checks both give the same output.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _gemv(W, X, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols = tl.arange(0, BLOCK_K)  # [BK]
    w_ptrs = W + rows[:, None].to(tl.int64) * K + cols[None, :]
    ok = rows[:, None] < N
    w = tl.load(w_ptrs, mask=ok, other=0.0)  # first weight tile: independent of the previous kernel
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + k0 + cols).to(tl.float32)  # [BK]
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if k0 + BLOCK_K < K:
            w = tl.load(w_ptrs + k0 + BLOCK_K, mask=ok, other=0.0)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=rows < N)


def gemv(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, pdl: bool) -> None:
    n, k = w.shape
    block_n, block_k = 8, 512
    assert k % block_k == 0, f"K={k} must be a multiple of {block_k}"
    _gemv[(triton.cdiv(n, block_n),)](w, x, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl,
                                      num_warps=4, launch_pdl=pdl)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    dev = torch.device("cuda")
    hidden, q_out, inter = 2560, 4096, 9728
    shapes = [(q_out + 2048, hidden), (hidden, q_out), (2 * inter, hidden), (hidden, inter)]
    weights = [torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.layers) for s in shapes]
    outs = [torch.empty(w.shape[0], device=dev, dtype=torch.bfloat16) for w in weights]
    x0 = torch.randn(hidden, device=dev, dtype=torch.bfloat16)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)

    def chain(pdl: bool) -> None:
        x = x0
        for w, y in zip(weights, outs):
            gemv(w, x[:w.shape[1]], y, pdl)
            x = y

    results = {}
    for pdl in (False, True, False, True):
        chain(pdl)  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(pdl)
        graph.replay()
        torch.cuda.synchronize()
        results.setdefault(pdl, []).append(outs[-1].clone())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.replays
        start.record()
        for _ in range(args.replays):
            chain(pdl)
        end.record()
        torch.cuda.synchronize()
        eager_ms = start.elapsed_time(end) / args.replays
        print(f"pdl={pdl}: graph {ms:.3f} ms per chain of {len(weights)} GEMVs ({weight_bytes / ms / 1e6:.0f} GB/s), "
              f"eager stream {eager_ms:.3f} ms")
    same = torch.equal(results[False][0], results[True][0])
    print(f"outputs equal with and without PDL: {same}")


if __name__ == "__main__":
    main()
