"""GPU micro-benchmark for graph.mode (CUDA only).

1. Decode ms/step, eager vs cudagraph (offload=none) and eager vs segmented (offload=cpu), on one engine per
   offload mode (the graph runner is attached and detached, so both modes see the same weights and KV layout).
2. Segment replay, per-layer graphs vs one shared graph with the weights as inputs (each layer's weights copied
   into the captured layer before its replay), for the post-attention segment of every layer: the measurement
   behind the per-layer design of graph.mode=segmented (sparsekv/graphs/segmented_graph.py).

    python tools/bench_cuda_graph.py [--model qwen3_4b] [--steps 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import time

import torch

from sparsekv import LLM, SamplingParams
from sparsekv.graphs.cuda_graph import attach_graph_runner
from sparsekv.engine.llm_engine import RunStats
from sparsekv.tasks.bench.floors import cuda_median_seconds
from sparsekv.tasks.bench.task import random_prompts


def decode_ms(llm: LLM, batch: int, context: int, steps: int, seed: int = 0) -> float:
    engine = llm.engine
    vocab = engine.spec.vocab_size
    engine.generate(random_prompts(batch, 64, vocab, seed + 1),
                    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))  # warm-up
    engine.stats = RunStats()
    engine.generate(random_prompts(batch, context, vocab, seed),
                    SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    times = sorted(engine.stats.step_seconds)
    return 1e3 * times[len(times) // 2]  # median step


def bench_modes(model: str, offload: list[str], mode: str, cases: list[tuple[int, int]], steps: int,
                max_model_len: int) -> list[dict]:
    overrides = [f"model={model}", "model.load_format=dummy", "dtype=bfloat16", "graph=eager",
                 f"scheduler.max_model_len={max_model_len}",
                 f"scheduler.max_num_seqs={max(b for b, _ in cases)}", *offload]
    llm = LLM(overrides=overrides)
    rows = []
    stats = None
    for batch, context in cases:
        llm.engine.runner.graph_runner = None
        eager = decode_ms(llm, batch, context, steps)
        if stats is None:
            stats = attach_graph_runner(llm.engine, mode, llm.config.graph)
            runner = llm.engine.runner.graph_runner
        llm.engine.runner.graph_runner = runner
        graphed = decode_ms(llm, batch, context, steps)
        row = {"offload": offload[0], "mode": mode, "batch": batch, "context": context, "eager_ms": eager,
               "graph_ms": graphed, "speedup": eager / graphed, "capture_seconds": stats["capture_seconds"],
               "graph_pool_mib": stats["graph_pool_bytes"] / 2**20, "num_graphs": stats["num_graphs"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def time_cuda(fn) -> float:
    """Median ms of one call (sparsekv.tasks.bench.floors' CUDA-event timer)."""
    return 1e3 * cuda_median_seconds(fn, warmup=1, repeats=5, inner=4)


@torch.inference_mode()
def bench_segment_designs(model: str, batches: list[int]) -> list[dict]:
    llm = LLM(overrides=[f"model={model}", "model.load_format=dummy", "dtype=bfloat16", "graph=eager",
                         "offload.num_kv_blocks=8"])
    net = llm.engine.model
    layers = list(net.layers)
    spec = llm.engine.spec
    rows = []
    for bs in batches:
        hidden = torch.randn(bs, spec.hidden_size, dtype=torch.bfloat16, device="cuda") * 0.1
        attn = torch.randn(bs, spec.num_attention_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda") * 0.1
        pool = torch.cuda.graph_pool_handle()

        def capture(fn):
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                fn()
            return graph

        per_layer = [capture(lambda layer=layer: layer.post_attention(hidden, attn)) for layer in layers]
        template = copy.deepcopy(layers[0])
        shared = capture(lambda: template.post_attention(hidden, attn))
        params = [(list(template.parameters()), list(layer.parameters())) for layer in layers]

        def run_per_layer():
            for graph in per_layer:
                graph.replay()

        def run_shared():
            for dst, src in params:
                torch._foreach_copy_(dst, src)
                shared.replay()

        def run_eager():
            for layer in layers:
                layer.post_attention(hidden, attn)

        row = {"segment": "post_attention x all layers", "batch": bs, "eager_ms": time_cuda(run_eager),
               "per_layer_graphs_ms": time_cuda(run_per_layer), "shared_graph_weight_copy_ms": time_cuda(run_shared)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del per_layer, shared, template
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_4b")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip", default="", help="comma list of: none,cpu,segments")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_graph.py needs CUDA")
    skip = set(filter(None, args.skip.split(",")))
    start = time.perf_counter()
    results = {"device": torch.cuda.get_device_name(0), "model": args.model}
    if "segments" not in skip:
        results["segments"] = bench_segment_designs(args.model, [1, 8])
    if "none" not in skip:
        results["none"] = bench_modes(args.model, ["offload=none", "offload.num_kv_blocks=160"], "cudagraph",
                                      [(1, 1024), (8, 1024), (1, 16384)], args.steps, 16384 + args.steps + 64)
    if "cpu" not in skip:
        results["cpu"] = bench_modes(args.model, ["offload=cpu", "offload.block_size=1024", "offload.num_gpu_blocks=4",
                                                  "offload.host_pool_gib=8"],
                                     "segmented", [(1, 2048), (4, 2048), (1, 16384)], args.steps,
                                     16384 + args.steps + 64)
    results["seconds"] = time.perf_counter() - start
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
