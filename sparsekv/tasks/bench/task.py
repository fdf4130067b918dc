"""task=bench: prefill and decode speed against the physical floors measured in the same run.

    python -m sparsekv task=bench model=qwen3_4b model.load_format=dummy task.context=32768 task.decode_steps=32
    python -m sparsekv -m task=bench policy=full,quest task.context=32768,131072
    python -m sparsekv.tasks.bench.task summarize outputs/        # Markdown table of every bench.json below a folder

Each run writes bench.json (tasks.common.write_record) holding the composed config and the figures:
achieved prefill/decode figures, the ceilings measured on this device (sparsekv.tasks.bench.floors), the floor each
figure is held against and the ratio achieved time / floor time (>= 1). On a CPU device the ceilings, floors
and ratios are None.

Floors:
  prefill      = prefill FLOPs (linear layers + causal attention) / measured dense GEMM rate
  decode (HBM) = (weight bytes + KV bytes attended + selection metadata) / measured HBM copy bandwidth, per step;
               KV attended: the context's, or under a budgeted block selection (quest) its selected blocks' and the
               unfinished block's (decode_kv_density of the context's), plus every full block's key bounds
  decode (PCIe, offload=cpu) = KV bytes loaded per step (as the store counted them; a block-selecting policy
               loads less than the context) / measured pinned H2D bandwidth; without counts, the context's KV bytes
The decode ratio is held against the larger (binding) of the decode floors.

Tensor parallelism (parallel.tensor_parallel_size=N): the prefill and HBM floors are one GPU's (FLOPs over N GPUs'
GEMM rate, weights/N + KV/N bytes over one GPU's HBM), and prefill_tflops is per GPU (the model's FLOPs / time / N),
held against one GPU's ceiling. The PCIe floor is the whole KV over the aggregate H2D rate: every rank measures its
own pinned H2D at the same time (floors.h2d_gbps_per_rank) and the rates are summed; the store's loaded-byte counts
are rank 0's, i.e. its heads' share, x N.

Decode ms/step is the median of engine.stats.step_seconds. Synchronous decode times a step from its launch to the
device's completion; overlapped decode (scheduler.async_decode, offload=none; "async_decode" in the record) times
it from the previous step's completion to its own, as the host sees them: the interval between consecutive steps,
host work between them included, i.e. the throughput the engine sustains.
"""
from __future__ import annotations

import copy
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from sparsekv.tasks.common import enum_value, policy_warnings, print_warnings, run_identity

from sparsekv.tasks.bench.decode import DecodeWork, curve_max_tokens, curve_sizes, ratio, settled, steps_at
from sparsekv.tasks.bench.summary import print_table, summarize

GIB = 1 << 30



def bench_config(cfg: DictConfig, spec) -> DictConfig:
    """A copy of `cfg` whose scheduler and KV pool fit the bench's requests."""
    task = cfg.task
    if task.context < 1:
        raise ValueError(f"task.context={task.context} must be at least 1 token")
    if task.decode_steps < 0:
        raise ValueError(f"task.decode_steps={task.decode_steps} must be 0 or more")
    if task.batch_size < 1:
        raise ValueError(f"task.batch_size={task.batch_size} must be at least 1")
    curve = curve_sizes(task.batch_curve, task.batch_size)
    cfg = copy.deepcopy(cfg)
    needed = task.context + task.decode_steps * max(1, len(curve)) + 1
    with open_dict(cfg):
        current = cfg.scheduler.max_model_len or spec.max_position_embeddings
        if current < needed:
            cfg.scheduler.max_model_len = needed
        if cfg.scheduler.max_num_seqs < task.batch_size:
            cfg.scheduler.max_num_seqs = task.batch_size
        if task.fit_kv_cache and enum_value(cfg.offload.mode) == "none" and not cfg.offload.num_kv_blocks:
            block = cfg.offload.block_size
            cfg.offload.num_kv_blocks = task.batch_size * (-(-needed // block) + 1)
    return cfg


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def _numeric_delta(after: dict | None, before: dict | None) -> dict | None:
    if after is None:
        return None
    before = before or {}
    return {k: v - before.get(k, 0) for k, v in after.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _transfer_snapshot(engine) -> dict | None:
    stats = engine.kv_store.transfer_stats  # empty for a store that moves no KV
    return dict(stats) if stats else None


class _Progress:
    """tqdm bars over the prefill (prompt tokens) and the decode (steps), fed by engine.generate's callback;
    also snapshots the KV store's transfer counters when the prefill ends."""

    def __init__(self, total_prompt_tokens: int, decode_steps: int, enabled: bool, start_transfers: dict | None):
        from tqdm import tqdm

        self.tqdm, self.enabled = tqdm, enabled
        self.prefill_bar = tqdm(total=total_prompt_tokens, desc="prefill", unit="tok", unit_scale=True,
                                mininterval=0.5, disable=not enabled, file=sys.stderr)
        self.decode_total = decode_steps
        self.decode_bar = None
        self.after_prefill = start_transfers
        self.decode_snapshots: list[dict | None] = []  # the store's counters after each decode step

    def __call__(self, engine) -> None:
        stats = engine.stats
        self.prefill_bar.update(stats.prompt_tokens - self.prefill_bar.n)
        if stats.decode_steps == 0:
            self.after_prefill = _transfer_snapshot(engine)
            return
        snapshot = _transfer_snapshot(engine)
        self.decode_snapshots += [snapshot] * (stats.decode_steps - len(self.decode_snapshots))
        if self.decode_bar is None:
            self.prefill_bar.close()
            self.decode_bar = self.tqdm(total=self.decode_total, desc="decode", unit="step", mininterval=0.5,
                                        disable=not self.enabled, file=sys.stderr)
        self.decode_bar.update(stats.decode_steps - self.decode_bar.n)

    def close(self) -> None:
        self.prefill_bar.close()
        if self.decode_bar is not None:
            self.decode_bar.close()


def warmup_length(cfg: DictConfig, engine) -> int:
    """Long enough that the timed run meets no kernel shape for the first time (Triton compiles per shape class):
    offloaded, a full prefill chunk plus full ring groups of earlier blocks and a decode over host blocks."""
    store = engine.kv_store
    if store.chunk_tokens is None:
        # resident: a chunk that attends to an earlier chunk's keys compiles kernels of its own; the engine's prefill
        # budget, not the config's (a whole_prompt_prefill policy raises it to max_model_len)
        return max(int(cfg.task.warmup_tokens),
                   2 * int(engine.scheduler.max_num_batched_tokens) + int(cfg.offload.block_size))
    # two full chunks (the second attends to ring groups), block-aligned so decode starts a fresh block and its
    # tail lengths go 1, 2, ..., 16, 17 (Triton specialises integers equal to 1 and divisible by 16)
    ring_tokens = store.block_size * max(2, store.engine.num_slots)
    return 2 * max(store.chunk_tokens, ring_tokens) + store.block_size


def run(cfg: DictConfig) -> dict:
    import time

    import torch

    from sparsekv.tasks.bench import floors as fl
    from sparsekv.engine.llm_engine import RunStats
    from sparsekv.factory import resolve_device, resolve_dtype
    from sparsekv.llm import LLM
    from sparsekv.models.loader import resolve_spec
    from sparsekv.sampling_params import SamplingParams
    from sparsekv.tasks.common import write_record

    spec = resolve_spec(cfg.model)
    cfg = bench_config(cfg, spec)
    task = cfg.task
    context, steps, batch = int(task.context), int(task.decode_steps), int(task.batch_size)
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)

    # Ceilings first, while the device memory is still free (offload=none takes most of it for the KV pool).
    floors = fl.measure_floors(device, dtype=dtype) if task.measure_floors else None
    tp_size = int(OmegaConf.select(cfg, "parallel.tensor_parallel_size", default=1))
    if floors is not None and tp_size > 1:  # the ranks' H2D measured together (starts the workers the build reuses)
        floors["h2d_gbps_per_rank"] = fl.ranks_h2d_gbps(tp_size, device.type)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    start = time.perf_counter()
    llm = LLM.from_config(cfg)
    engine = llm.engine
    build_seconds = time.perf_counter() - start
    gpu_build_peak_gib = None
    if device.type == "cuda":  # the run's peak (weights + KV + activations), not the loader's transient peak
        torch.cuda.synchronize(device)
        gpu_build_peak_gib = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)

    curve = curve_sizes(task.batch_curve, batch)

    def sampling(decode_steps: int) -> SamplingParams | list[SamplingParams]:
        """Greedy, `decode_steps` steps per sequence, or per curve point (each point's batch decodes that many)."""
        if not curve:
            return SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
        return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                for n in curve_max_tokens(curve, decode_steps)]

    warmup_seconds = None
    if task.warmup:  # a curve's warm-up runs every point's batch size too
        warm_len = max(1, min(context, warmup_length(cfg, engine)))
        warm = random_prompts(batch, warm_len, spec.vocab_size, cfg.seed + 1)
        start = time.perf_counter()
        engine.generate(warm, sampling(min(steps, 18)))
        warmup_seconds = time.perf_counter() - start
    engine.stats = RunStats()
    # offload=cpu: pin the host blocks this run needs before timing (first-use pinning is reported apart)
    decode_steps = steps * max(1, len(curve))  # a curve: `steps` at each point
    host_pool_reserve_seconds = engine.reserve(batch * (context + decode_steps + 1))

    prompts = random_prompts(batch, context, spec.vocab_size, cfg.seed)
    policy = engine.policy
    warnings = policy_warnings(policy, range(spec.num_hidden_layers), int(cfg.offload.block_size), context)
    print_warnings(warnings)
    policy.reset_density()  # the timed run's density only, not the warm-up's
    params = sampling(steps)
    start_transfers = _transfer_snapshot(engine)
    progress = _Progress(batch * context, decode_steps, bool(task.progress), start_transfers)
    start = time.perf_counter()
    try:
        outputs = engine.generate(prompts, params, progress=progress)
    finally:
        progress.close()
    wall_seconds = time.perf_counter() - start
    end_transfers = _transfer_snapshot(engine)
    stats = engine.stats

    # ---- achieved
    figures: dict[str, Any] = {
        **run_identity(cfg, engine, task.label),
        "batch_size": batch,
        "context": context,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": sum(len(o.token_ids) for o in outputs),
        "async_decode": engine.overlap is not None,  # decode steps overlapped the host's work (engine/overlap.py)
        "host_dtype": enum_value(cfg.offload.get("host_dtype", "auto")),  # offload=cpu: KV in host memory
        "build_seconds": build_seconds,
        "warmup_seconds": warmup_seconds,
        "host_pool_reserve_seconds": host_pool_reserve_seconds,
        "wall_seconds": wall_seconds,
        "prefill_seconds": stats.prefill_seconds,
        "prefill_tok_s": stats.prefill_tok_s,
        "decode_tok_s_mean": stats.decode_tok_s,
        # a policy that records densities: share of the causally visible attention it computed (its own unit)
        "policy_density": policy.mean_density,
        "warnings": warnings,  # the policy selects nothing or everything on this run's shape (tasks.common)
    }

    # ---- work and floors
    host_dtype = cfg.offload.get("host_dtype", "auto")  # fp8 host KV: count its bytes and scales
    dtype_bytes = fl.kv_element_bytes(engine.dtype, host_dtype, int(cfg.offload.block_size), spec.head_dim)
    wbytes = fl.weight_bytes(engine.model, skip_untied_embedding=True)
    flops = fl.prefill_flops(spec, context, batch=batch)
    # tensor parallelism: the floors of one GPU (its weights, its KV heads; prefill on N GPUs' GEMM rate) and the
    # PCIe floor of the whole KV over the ranks' summed H2D rate
    tp_size = figures["tensor_parallel_size"]
    floor = (lambda key: floors.get(key) if floors else None)
    matmul = floor("matmul_tflops")
    h2d = fl.aggregate_h2d_gbps(floor("h2d_gbps"), floor("h2d_gbps_per_rank"), tp_size)
    figures["h2d_gbps_per_rank"] = floor("h2d_gbps_per_rank")
    figures["h2d_gbps_aggregate"] = h2d
    # a budgeted block selection (quest) reads its selected blocks' KV and every full block's key bounds, not the
    # whole context's KV (its selection's length is fixed, so the count is exact)
    work = DecodeWork(fl.per_gpu_spec(spec, tp_size), context, int(cfg.offload.block_size), spec.num_hidden_layers,
                      policy if policy.supports_decode else None, dtype_bytes, fl.kv_bytes_per_token(spec, dtype_bytes),
                      wbytes, engine.dtype, floor("hbm_gbps"), h2d, figures["offload"] == "cpu", tp_size)
    counted = end_transfers is not None  # a store that counts the KV it moves (offload stores)
    snapshots = progress.decode_snapshots if counted else None
    # a plain run: every decode step; a batch curve: the widest point here, each point under "batch_curve"
    every_step = list(range(len(stats.step_seconds)))
    main_steps = settled(steps_at(stats.step_batch_sizes, batch)) if curve else every_step
    figures.update(work.figures(batch, stats.step_seconds, main_steps, snapshots, progress.after_prefill))
    if curve:
        figures["batch_curve"] = [work.figures(size, stats.step_seconds,
                                               settled(steps_at(stats.step_batch_sizes, size)),
                                               snapshots, progress.after_prefill) for size in curve]
    if counted:
        figures["kv_transfer"].update({"prefill": _numeric_delta(progress.after_prefill, start_transfers),
                                       "raw": end_transfers})
        if engine.kv_store.cache_stats:  # GPU block cache: its size and counters (hit rate: the decode steps')
            figures["gpu_cache"] = dict(engine.kv_store.cache_stats)
            figures["gpu_cache_gib"] = figures["gpu_cache"]["cache_bytes"] / 2**30
            figures.setdefault("gpu_cache_hit_rate", None)

    prefill_floor_s = flops / (matmul * 1e12 * tp_size) if matmul else None
    figures.update({
        "weight_bytes": wbytes,
        "kv_bytes_per_token": work.kv_bytes_per_token,
        "prefill_flops": flops,
        # per GPU: the whole model's FLOPs over the time, shared by the N GPUs (held against one GPU's ceiling)
        "prefill_tflops": flops / stats.prefill_seconds / 1e12 / tp_size if stats.prefill_seconds else None,
        "prefill_floor_s": prefill_floor_s,
        "prefill_ratio": ratio(stats.prefill_seconds, prefill_floor_s),
    })

    # decode graphs: capture time and memory (captured at build; offload=cpu captures per KV layout as it goes)
    runner = engine.runner.graph_runner
    figures["graph"] = {**engine.graph_stats, **({"replayed_steps": runner.replayed_steps,
                                                   "eager_steps": runner.eager_steps} if runner else {})}
    figures.update(engine.peak_memory())
    figures.setdefault("gpu_peak_gib", None)
    figures["gpu_build_peak_gib"] = gpu_build_peak_gib
    figures["floors"] = floors

    # ---- HF transformers baseline on the same prompts (task.baseline=true; code in sparsekv.tasks.bench.baseline)
    if cfg.task.baseline:
        import gc

        from sparsekv.tasks.bench.baseline import baseline_figures

        del outputs, engine, llm, progress  # hand the engine's weights and KV pool back before HF builds its model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        figures["hf_baseline"] = baseline_figures(cfg, prompts)

    print_table(figures)
    print_warnings(warnings)
    path = write_record(cfg, "bench", figures, spec)
    print(f"record: {path}")
    return figures


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "summarize":
        print("usage: python -m sparsekv.tasks.bench.task summarize DIR", file=sys.stderr)
        return 2
    summarize(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
