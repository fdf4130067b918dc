"""Latency of one small all-reduce on N GPUs, as a batch-1 tensor-parallel decode step issues them: bf16 vectors of
one hidden state (4096 / 8192 elements), 72 calls back to back (2 per layer of a 36-layer model), captured in one
CUDA graph and replayed. Variants (each in its own try, so one failing still prints the others):

    nccl eager          dist.all_reduce, not captured (what a segmented or eager step pays)
    nccl graph          dist.all_reduce captured in the graph (the engine's decode with graph=cudagraph)
    symm one_shot       torch.ops.symm_mem.one_shot_all_reduce_out, input already in a symmetric buffer
    symm one_shot_copy  one_shot_all_reduce_copy: a regular tensor copied into the symmetric buffer, then reduced
                        (what the engine would run: the row-parallel output is an ordinary tensor)
    symm two_shot       two_shot_all_reduce_ in place on the symmetric buffer

Only the peer-to-peer symmetric-memory ops are used, never the multimem ones: NVLink multicast stays off
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NCCL_NVLS_ENABLE=0 are kept, and set when absent).

    python3 tools/bench_allreduce.py                    # every visible GPU (at least 2)
    python3 tools/bench_allreduce.py --gpus 2 --sizes 4096 8192 --calls 72

Prints `nvidia-smi topo -m` and a table of microseconds per call (the slowest rank's), with a correctness check of
each variant (ranks contribute rank + 1: the sum is N (N + 1) / 2). Runs in well under a minute; a variant that
hangs is cut off by the overall deadline (--deadline, default 55 s) and the rows done so far stay printed.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import traceback
from typing import Callable

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # never unset where the host sets them
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _time_graph(step: Callable[[], None], calls: int, replays: int) -> float:
    """Seconds per call of `calls` captured calls of `step`, replayed `replays` times (after warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    return _time_replays(graph.replay, calls, replays, keep=graph)


def _time_eager(step: Callable[[], None], calls: int, replays: int) -> float:
    for _ in range(3):
        step()

    def run() -> None:
        for _ in range(calls):
            step()
    return _time_replays(run, calls, replays)


def _time_replays(run: Callable[[], None], calls: int, replays: int, keep=None) -> float:
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        run()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / (replays * calls)
    slowest = torch.tensor([seconds], device="cuda", dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    del keep
    return float(slowest.item())


Setup = Callable[[], tuple[Callable[[], None], Callable[[], torch.Tensor], bool]]


def _variants(numel: int, rank: int, group_name: str) -> dict[str, Setup]:
    """name -> setup() returning (step, result tensor after the last call, captured in a graph)."""
    dtype, device = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(rank + 1)

    def nccl(captured: bool):
        def setup():
            x = torch.empty(numel, dtype=dtype, device=device)

            def step():  # refilled each call: in place, the sum would grow without bound
                fill(x)
                dist.all_reduce(x)
            return step, (lambda: x), captured
        return setup

    def symm(kind: str):
        def setup():
            from torch.distributed import _symmetric_memory as symm_mem

            try:
                symm_mem.enable_symm_mem_for_group(group_name)  # needed before torch 2.9, a no-op after
            except Exception:  # noqa: BLE001
                pass
            buf = symm_mem.empty(numel, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, group_name)
            out = torch.empty(numel, dtype=dtype, device=device)
            local = torch.empty(numel, dtype=dtype, device=device)
            ops = torch.ops.symm_mem
            if kind == "one_shot":
                def step():
                    fill(buf)
                    ops.one_shot_all_reduce_out(buf, "sum", group_name, out)
                return step, (lambda: out), True
            if kind == "one_shot_copy":
                result = [out]

                def step():
                    fill(local)
                    result[0] = ops.one_shot_all_reduce_copy(buf, local, "sum", group_name)
                return step, (lambda: result[0]), True
            def step():  # two_shot, in place
                fill(buf)
                ops.two_shot_all_reduce_(buf, "sum", group_name)
            return step, (lambda: buf), True
        return setup

    return {"nccl eager": nccl(False), "nccl graph": nccl(True), "symm one_shot": symm("one_shot"),
            "symm one_shot_copy": symm("one_shot_copy"), "symm two_shot": symm("two_shot")}


def _fill_cost(numel: int, calls: int, replays: int) -> float:
    """Seconds of the per-call fill that every variant's step includes (subtracted from the figures; for the eager
    variant this is the fill's device time only, its launch cost stays in)."""
    x = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    return _time_graph(lambda: x.fill_(1), calls, replays)


def worker(rank: int, size: int, port: int, sizes: list[int], calls: int, replays: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))
    group_name = dist.group.WORLD.group_name
    expected = size * (size + 1) / 2
    if rank == 0:
        print(f"{'variant':<20} {'elements':>8} {'us/call':>9}  check", flush=True)
    for numel in sizes:
        fill_s = _fill_cost(numel, calls, replays)
        for name, setup in _variants(numel, rank, group_name).items():
            line, error = "", None
            try:
                step, result, captured = setup()
                seconds = (_time_graph if captured else _time_eager)(step, calls, replays) - fill_s
                torch.cuda.synchronize()
                ok = bool(torch.all(result().float() == expected).item())
                line = f"{name:<20} {numel:>8} {1e6 * seconds:>9.2f}  {'ok' if ok else 'WRONG SUM'}"
            except Exception as exc:  # noqa: BLE001 - one variant failing leaves the others' rows
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:120]
                line = f"{name:<20} {numel:>8} {'-':>9}  failed: {error}"
                if os.environ.get("BENCH_ALLREDUCE_TRACE"):
                    traceback.print_exc()
            if rank == 0:
                print(line, flush=True)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192], help="bf16 elements per all-reduce")
    parser.add_argument("--calls", type=int, default=72, help="all-reduces per captured graph (2 per layer)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--deadline", type=float, default=55.0, help="seconds before the ranks are stopped")
    args = parser.parse_args()
    if args.gpus < 2:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"--gpus={args.gpus}: an all-reduce needs at least 2 CUDA devices ({visible} visible); run it on a "
              "host with 2 or more GPUs", file=sys.stderr)
        return 2
    try:
        print(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10).stdout)
    except Exception as exc:  # noqa: BLE001
        print(f"nvidia-smi topo -m: {exc}")
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        nccl = "?"
    print(f"torch {torch.__version__}, NCCL {nccl}, {args.gpus} GPUs, "
          f"{args.calls} calls per graph x {args.replays} replays; TORCH_SYMM_MEM_DISABLE_MULTICAST="
          f"{os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST']} NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}",
          flush=True)
    start = time.monotonic()
    context = mp.spawn(worker, args=(args.gpus, _free_port(), args.sizes, args.calls, args.replays),
                       nprocs=args.gpus, join=False)
    try:
        while not context.join(timeout=max(0.1, args.deadline - (time.monotonic() - start))):
            if time.monotonic() - start >= args.deadline:
                print(f"deadline of {args.deadline:.0f} s reached: stopping the ranks (a variant hung)", flush=True)
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                return 1
    except Exception as exc:  # noqa: BLE001 - a rank's error: its traceback is above
        print(f"a rank failed: {exc}", file=sys.stderr)
        return 1
    print(f"done in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
