"""Where a long prefill's time goes (CUDA only): wall time against GPU kernel time, and the top kernels.

    python tools/profile_prefill.py --context 131072 [overrides ...]
    python tools/profile_prefill.py --context 131072 model.load_format=dummy_structured policy=xattn_bsa_090

Runs the prefill of --context random tokens twice unprofiled (the first compiles every kernel variant the prompt's
chunks need; the second gives the wall time), then once under torch.profiler, and prints the kernel time summed by
kernel name (top 45), so the attention kernels, the policy's estimate and the dense layers (GEMMs, norms, rotary,
KV writes) can be weighed against the wall time, and the GPU's idle time in the profiled prefill with its longest
gaps (the kernels or device copies either side), where the host kept the GPU waiting. --trace keeps the Chrome
trace. Model: Qwen3-4B dummy weights.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kernel_timeline import timeline
from profile_decode import _device_us
from sparsekv import LLM, SamplingParams
from sparsekv.tasks.bench.task import random_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--trace", default=None, help="write the profiled prefill's Chrome trace here")
    parser.add_argument("--gaps", type=int, default=12, help="longest idle gaps to print")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    model = [] if any(o.startswith("model=") for o in args.overrides) else ["model=qwen3_4b", "model.load_format=dummy"]
    if not any(o.startswith("scheduler.max_model_len=") for o in args.overrides):
        model.append(f"scheduler.max_model_len={args.context + 8}")
    llm = LLM(overrides=[*model, *args.overrides])
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.generate(random_prompts(1, 1024, engine.spec.vocab_size, 1), params)  # compile
    prompt = random_prompts(1, args.context, engine.spec.vocab_size, 0)
    engine.reserve(args.context + 1)  # offload=cpu: the host pool stays pinned between the runs, as the bench's does

    engine.generate(prompt, params)  # compiles the variants the long prompt's chunks need
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompt, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompt, params)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if _device_us(e) > 0]
    kernel_s = sum(_device_us(e) for e in kernels if "memcpy" not in e.key.lower()) / 1e6
    trace = args.trace or os.path.join(tempfile.mkdtemp(), "prefill.json")
    prof.export_chrome_trace(trace)
    # host <-> device copies run on the copy engines beside the compute; a device-to-device copy or a memset is the
    # compute stream's own work, not idle time
    gpu_events, _, idle_us, span_us = timeline(trace, exclude=("HtoD", "DtoH"))
    print(json.dumps({"context": args.context, "overrides": args.overrides, "prefill_wall_s": round(wall, 3),
                      "kernel_s": round(kernel_s, 3), "profiled_span_s": round(span_us / 1e6, 3),
                      "compute_idle_s": round(idle_us / 1e6, 3)}), flush=True)
    for e in sorted(kernels, key=_device_us, reverse=True)[:45]:
        print(f"{_device_us(e) / 1e6:8.3f} s {e.count:7d}x  {e.key[:110]}")
    gpu_events.sort(key=lambda e: float(e["ts"]))
    gaps, busy_until = [], None
    for before, after in zip(gpu_events, gpu_events[1:]):
        end = float(before["ts"]) + float(before["dur"])
        busy_until = end if busy_until is None else max(busy_until, end)
        if float(after["ts"]) > busy_until:
            gaps.append((float(after["ts"]) - busy_until, before["name"], after["name"]))
    gaps.sort(reverse=True)
    print(f"idle gaps: {len(gaps)}, over 100 us: {sum(g[0] > 100 for g in gaps)} "
          f"({sum(g[0] for g in gaps if g[0] > 100) / 1e6:.3f} s)")
    for us, before, after in gaps[:args.gaps]:
        print(f"{us:10.1f} us  after {before[:60]}  before {after[:60]}")


if __name__ == "__main__":
    main()
