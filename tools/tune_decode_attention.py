"""Sweep the paged decode attention's settings (sparsekv/kernels/paged_attention.py) as the decode step runs it.

For batch 1 / 8 and context 4K / 32K at Qwen3-4B dims (32 q heads, 8 KV heads, D=128, bf16, block_size 256) it
captures `--layers` back-to-back calls in one CUDA graph, one per layer over separate caches (cycled, so that the
KV is never L2-resident), and prints microseconds per layer and GB/s of KV read for each candidate, best first:

* stage 1: MIN_SPLIT_TOKENS x PROGRAMS_PER_SM x PDL off / on, default tiles;
* stage 2: the best stage-1 setting over BLOCK_N / NUM_WARPS / NUM_STAGES.

    python3 tools/tune_decode_attention.py [--batches 1 8] [--contexts 4096 32768] [--plan-len N]
    python3 tools/tune_decode_attention.py --smoke   # CPU, TRITON_INTERPRET=1, tiny sizes: checks the script

--plan-len: the store plans splits from max_model_len (PagedKVStore.decode_plan), not from the context; give
the engine's max_model_len to time the plan it really runs (default: the context). Each row's `diff` is its
max |o - o_default| on the first layer (a different split plan rounds differently; 0 = bitwise).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from sparsekv.kernels import _dispatch  # noqa: E402
from sparsekv.kernels import paged_attention as P  # noqa: E402
from sparsekv.kernels.backend import resolve_kernels  # noqa: E402

STAGE1 = dict(MIN_SPLIT_TOKENS=(64, 128, 256), PROGRAMS_PER_SM=(4, 8), pdl=(False, True))
KERNELS = None  # the KernelChoice of the candidate being timed (settings)
STAGE2 = [  # (BLOCK_N, NUM_WARPS, NUM_STAGES); KV_TILE_BYTES is raised so that BLOCK_N is not capped
    (64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (32, 4, 3), (32, 2, 3), (32, 4, 4), (128, 8, 3), (128, 4, 2),
]


@contextlib.contextmanager
def settings(pdl: bool = False, **constants):
    """Module constants of paged_attention, and PDL (where the GPU has it), for the duration."""
    global KERNELS
    saved = {name: getattr(P, name) for name in constants}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = resolve_kernels(device, backend="triton")
    try:
        for name, value in constants.items():
            setattr(P, name, value)
        KERNELS = dataclasses.replace(resolved, pdl=pdl and resolved.pdl)
        yield
    finally:
        for name, value in saved.items():
            setattr(P, name, value)
        KERNELS = None


class Case:
    """q [B, H, D], `caches` layers of K/V [blocks, block_size, KVH, D] and shuffled block tables [B, blocks]."""

    def __init__(self, batch: int, context: int, args, device: torch.device):
        self.batch, self.context, self.plan_len = batch, context, args.plan_len or context
        h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
        blocks_per_seq = -(-context // bs)
        num_blocks = batch * blocks_per_seq
        self.kv_bytes = 2 * batch * context * kvh * d * 2  # K and V read per layer (bf16)
        per_layer = 2 * num_blocks * bs * kvh * d * 2
        self.num_caches = max(1, min(args.layers, int(args.cache_gib * 2**30) // per_layer))
        dtype = torch.float32 if args.smoke else torch.bfloat16
        shape = (self.num_caches, num_blocks, bs, kvh, d)
        self.k = torch.empty(shape, dtype=dtype, device=device).normal_()
        self.v = torch.empty(shape, dtype=dtype, device=device).normal_()
        perm = torch.randperm(num_blocks, device=device).int()
        self.tables = perm.view(batch, blocks_per_seq)  # [B, blocks_per_seq]
        self.lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, h, d, dtype=dtype, device=device)
        self.layers = args.layers

    def call(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer % self.num_caches
        return P.paged_decode_attention(self.q, self.k[i], self.v[i], self.tables, self.lens,
                                        max_context_len=self.plan_len, kernels=KERNELS)

    def num_splits(self, device: torch.device) -> int:
        block_n = P.INTERPRET_BLOCK_N if _dispatch.INTERPRET else max(
            16, min(P.BLOCK_N, P.KV_TILE_BYTES // (self.q.shape[-1] * self.q.element_size())))
        asked = P.choose_num_splits(self.batch, self.k.shape[3], self.plan_len, device)
        split_len = -(-(-(-self.plan_len // asked)) // block_n) * block_n
        return -(-self.plan_len // split_len)

    def time_us(self, replays: int) -> tuple[float, torch.Tensor]:
        """(us per layer, first layer's o) of `layers` calls back to back: one CUDA graph on GPU."""
        first = self.call(0)[0].clone()  # compiles; makes the fused reduce's counters outside capture
        if self.q.device.type != "cuda":
            start = time.perf_counter()
            for layer in range(self.layers):
                self.call(layer)
            return (time.perf_counter() - start) * 1e6 / self.layers, first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [self.call(layer) for layer in range(self.layers)]
        for _ in range(3):
            graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replayed = outs[0][0].clone()
        if not torch.equal(replayed, first):
            raise RuntimeError(f"graph replay differs from the eager call: max |diff| "
                               f"{(replayed.float() - first.float()).abs().max().item():.3g}")
        del graph, outs
        return begin.elapsed_time(end) * 1e3 / (replays * self.layers), first


def run_candidate(case: Case, rows: list, base: torch.Tensor | None, replays: int, device: torch.device,
                  **values) -> torch.Tensor | None:
    with settings(**values):
        label = " ".join(f"{k}={v}" for k, v in values.items())
        try:
            us, first = case.time_us(replays)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report the row and go on
            print(f"  {label} failed: {type(exc).__name__}: {exc}"[:240], flush=True)
            return base
        diff = 0.0 if base is None else (first.float() - base.float()).abs().max().item()
        rows.append((us, values, case.num_splits(device), diff))
    return first if base is None else base


def report(case: Case, rows: list, title: str) -> None:
    rows.sort(key=lambda r: r[0])
    print(f"B={case.batch} context={case.context} plan_len={case.plan_len} ({case.num_caches} caches, "
          f"{case.kv_bytes / 2**20:.1f} MiB KV per layer) {title}:", flush=True)
    for us, values, splits, diff in rows:
        text = " ".join(f"{k}={v}" for k, v in values.items()) or "defaults (no PDL)"
        print(f"  {us:8.2f} us/layer {case.kv_bytes / us / 1e3:7.0f} GB/s  splits={splits:3d}  {text}  "
              f"diff={diff:.2g}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--plan-len", type=int, default=None, help="max_context_len the plan uses (default: context)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--cache-gib", type=float, default=12.0, help="device memory for the per-layer caches")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--no-stage2", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.contexts, args.layers, args.replays = [1, 3], [200], 2, 1
        args.heads, args.kv_heads, args.head_dim, args.block_size, args.cache_gib = 4, 2, 32, 16, 0.01
        STAGE1.update(MIN_SPLIT_TOKENS=(64, 128), PROGRAMS_PER_SM=(4,))
        del STAGE2[2:]
    elif not torch.cuda.is_available():
        sys.exit("needs CUDA (or --smoke for a CPU check of the script)")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    t0 = time.perf_counter()
    for batch, context in itertools.product(args.batches, args.contexts):
        case = Case(batch, context, args, device)
        rows: list = []
        base = run_candidate(case, rows, None, args.replays, device)  # the module's defaults, no PDL
        for combo in itertools.product(*STAGE1.values()):
            base = run_candidate(case, rows, base, args.replays, device, **dict(zip(STAGE1, combo)))
        report(case, rows, "stage 1")
        best = rows[0][1] if rows else None
        if best is not None and not args.no_stage2:
            rows2: list = []
            for block_n, warps, stages in STAGE2:
                base = run_candidate(case, rows2, base, args.replays, device, **best, BLOCK_N=block_n,
                                     KV_TILE_BYTES=block_n * args.head_dim * 2, NUM_WARPS=warps,
                                     NUM_STAGES=stages)
            report(case, rows2, "stage 2")
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
