"""Where a decode step's time goes (CUDA only): wall time against GPU busy time, top kernels, top host ops.

    python tools/profile_decode.py --name quest-32k --context 32768 --out DIR offload=cpu policy=quest ...

Prefills --batch random prompts of --context tokens each, runs --warmup decode steps, then profiles --steps steps with
torch.profiler. Prints the median step wall time, the GPU kernel time and H2D copy time per step (kernels replayed
from CUDA graphs included), the idle share, the top kernels and the top host ops by self time, and writes a
Chrome trace of the profiled steps to DIR/NAME.trace.json.gz. The model defaults to Qwen3-4B with dummy weights.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from sparsekv import LLM, SamplingParams
from sparsekv.tasks.bench.task import random_prompts


def _device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    model = [] if any(o.startswith("model=") for o in args.overrides) else ["model=qwen3_4b", "model.load_format=dummy"]
    total = args.warmup + 2 * args.steps + 4
    if not any(o.startswith("scheduler.max_model_len=") for o in args.overrides):  # as task=bench: room for the run
        model.append(f"scheduler.max_model_len={args.context + total + 1}")
    llm = LLM(overrides=[*model, *args.overrides])
    engine = llm.engine
    engine.generate(random_prompts(1, 256, engine.spec.vocab_size, 1),
                    SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True))  # compile and capture
    seqs = [engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True))
            for prompt in random_prompts(args.batch, args.context, engine.spec.vocab_size, 0)]
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in seqs):
        engine.step()
    for _ in range(args.warmup):
        engine.step()

    walls = []
    for _ in range(args.steps):  # unprofiled timing: the profiler itself slows the host side
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_us = sum(_device_us(e) for e in events if "memcpy" not in e.key.lower() and "memset" not in e.key.lower())
    copy_us = sum(_device_us(e) for e in events if "memcpy" in e.key.lower())
    wall_ms = 1e3 * statistics.median(walls)
    summary = {"name": args.name, "context": args.context, "batch": args.batch, "overrides": args.overrides,
               "step_wall_ms": wall_ms, "gpu_kernel_ms_per_step": kernel_us / 1e3 / args.steps,
               "copy_ms_per_step": copy_us / 1e3 / args.steps}
    summary["kernel_busy_share"] = summary["gpu_kernel_ms_per_step"] / wall_ms
    print(json.dumps(summary), flush=True)
    print(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    trace = args.out / f"{args.name}.trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()


if __name__ == "__main__":
    main()
