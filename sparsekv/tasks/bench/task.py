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
import statistics
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from sparsekv.tasks.common import BudgetedSelection, enum_value, policy_warnings, print_warnings, run_identity

from sparsekv.tasks.bench.summary import print_table, summarize

GIB = 1 << 30


def _ratio(seconds: float | None, floor_seconds: float | None) -> float | None:
    if not seconds or not floor_seconds:
        return None
    return seconds / floor_seconds


def bench_config(cfg: DictConfig, spec) -> DictConfig:
    """A copy of `cfg` whose scheduler and KV pool fit the bench's requests."""
    task = cfg.task
    if task.context < 1:
        raise ValueError(f"task.context={task.context} must be at least 1 token")
    if task.decode_steps < 0:
        raise ValueError(f"task.decode_steps={task.decode_steps} must be 0 or more")
    if task.batch_size < 1:
        raise ValueError(f"task.batch_size={task.batch_size} must be at least 1")
    cfg = copy.deepcopy(cfg)
    needed = task.context + task.decode_steps + 1
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
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


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

    def __call__(self, engine) -> None:
        stats = engine.stats
        self.prefill_bar.update(stats.prompt_tokens - self.prefill_bar.n)
        if stats.decode_steps == 0:
            self.after_prefill = _transfer_snapshot(engine)
            return
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
        # resident: a chunk that attends to an earlier chunk's keys compiles kernels of its own
        return max(int(cfg.task.warmup_tokens),
                   2 * int(cfg.scheduler.max_num_batched_tokens) + int(cfg.offload.block_size))
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

    warmup_seconds = None
    if task.warmup:
        warm_len = max(1, min(context, warmup_length(cfg, engine)))
        warm = random_prompts(batch, warm_len, spec.vocab_size, cfg.seed + 1)
        start = time.perf_counter()
        engine.generate(warm, SamplingParams(temperature=0.0, max_tokens=min(steps, 18) + 1, ignore_eos=True))
        warmup_seconds = time.perf_counter() - start
    engine.stats = RunStats()
    # offload=cpu: pin the host blocks this run needs before timing (first-use pinning is reported apart)
    host_pool_reserve_seconds = engine.reserve(batch * (context + steps + 1))

    prompts = random_prompts(batch, context, spec.vocab_size, cfg.seed)
    policy = engine.policy
    warnings = policy_warnings(policy, range(spec.num_hidden_layers), int(cfg.offload.block_size), context)
    print_warnings(warnings)
    policy.reset_density()  # the timed run's density only, not the warm-up's
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    start_transfers = _transfer_snapshot(engine)
    progress = _Progress(batch * context, steps, bool(task.progress), start_transfers)
    start = time.perf_counter()
    try:
        outputs = engine.generate(prompts, params, progress=progress)
    finally:
        progress.close()
    wall_seconds = time.perf_counter() - start
    end_transfers = _transfer_snapshot(engine)
    stats = engine.stats

    # ---- achieved
    step_s = stats.step_seconds
    decode_median_s = statistics.median(step_s) if step_s else None
    decode_mean_s = statistics.mean(step_s) if step_s else None
    figures: dict[str, Any] = {
        **run_identity(cfg, engine, task.label),
        "batch_size": batch,
        "context": context,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": sum(len(o.token_ids) for o in outputs),
        "decode_steps": stats.decode_steps,
        "async_decode": engine.overlap is not None,
        "host_dtype": enum_value(cfg.offload.get("host_dtype", "auto")),  # offload=cpu: KV in host memory  # decode steps overlapped the host's work (engine/overlap.py)
        "build_seconds": build_seconds,
        "warmup_seconds": warmup_seconds,
        "host_pool_reserve_seconds": host_pool_reserve_seconds,
        "wall_seconds": wall_seconds,
        "prefill_seconds": stats.prefill_seconds,
        "prefill_tok_s": stats.prefill_tok_s,
        "decode_ms_per_token": 1e3 * decode_median_s if decode_median_s is not None else None,  # median step
        "decode_ms_per_token_mean": 1e3 * decode_mean_s if decode_mean_s is not None else None,
        "decode_tok_s": batch / decode_median_s if decode_median_s else None,  # all sequences, median step
        "decode_tok_s_mean": stats.decode_tok_s,
        # a policy that records densities: share of the causally visible attention it computed (its own unit)
        "policy_density": policy.mean_density,
        "warnings": warnings,  # the policy selects nothing or everything on this run's shape (tasks.common)
    }

    # ---- work and floors
    host_dtype = cfg.offload.get("host_dtype", "auto")  # fp8 host KV: count its bytes and scales
    dtype_bytes = fl.kv_element_bytes(engine.dtype, host_dtype, int(cfg.offload.block_size), spec.head_dim)
    wbytes = fl.weight_bytes(engine.model, skip_untied_embedding=True)
    decode_context = context + steps // 2  # the KV length at the median decode step
    flops = fl.prefill_flops(spec, context, batch=batch)
    # tensor parallelism: the floors of one GPU (its weights, its KV heads; prefill on N GPUs' GEMM rate) and the
    # PCIe floor of the whole KV over the ranks' summed H2D rate
    tp_size = figures["tensor_parallel_size"]
    gpu_spec = fl.per_gpu_spec(spec, tp_size)
    # a budgeted block selection (quest) reads its selected blocks' KV and every full block's key bounds, not the
    # whole context's KV (its selection's length is fixed, so the count is exact)
    kv_density, selecting_layers, block = 1.0, 0, int(cfg.offload.block_size)
    decode_policy = policy if policy.supports_decode else None
    if isinstance(decode_policy, BudgetedSelection):
        attended, selecting_layers = fl.budgeted_selection(
            decode_context, block, spec.num_hidden_layers, decode_policy.budget_blocks(block),
            decode_policy.dense_layers, decode_policy.threshold_blocks)
        kv_density = attended / decode_context
    metadata_bytes = fl.block_bounds_bytes(gpu_spec, decode_context, block, batch, selecting_layers, engine.dtype)
    dbytes = fl.decode_bytes(gpu_spec, decode_context, batch, dtype_bytes, wbytes, kv_density, metadata_bytes)
    kv_context_bytes = batch * decode_context * fl.kv_bytes_per_token(spec, dtype_bytes)  # all ranks' KV heads
    floor = (lambda key: floors.get(key) if floors else None)
    matmul, hbm = floor("matmul_tflops"), floor("hbm_gbps")
    h2d = fl.aggregate_h2d_gbps(floor("h2d_gbps"), floor("h2d_gbps_per_rank"), tp_size)
    figures["h2d_gbps_per_rank"] = floor("h2d_gbps_per_rank")
    figures["h2d_gbps_aggregate"] = h2d

    # ---- bytes the KV store says it moved (offload stores that count them)
    loaded_floor_s = None  # offloaded: the bytes the store loaded per step over the measured H2D rate
    if end_transfers is not None:
        prefill_moved = _numeric_delta(progress.after_prefill, start_transfers)
        decode_moved = _numeric_delta(end_transfers, progress.after_prefill)
        per_step = {k: v / stats.decode_steps for k, v in decode_moved.items()} if stats.decode_steps else None
        figures["kv_transfer"] = {"prefill": prefill_moved, "decode": decode_moved, "decode_per_step": per_step,
                                  "raw": end_transfers}
        h2d_keys = [k for k in (per_step or {}) if "h2d" in k.lower() and "byte" in k.lower()]
        if h2d_keys and h2d:
            loaded = sum(per_step[k] for k in h2d_keys) * tp_size  # rank 0 counts its heads' share
            figures["decode_h2d_bytes_per_step"] = loaded
            loaded_floor_s = loaded / (h2d * 1e9)
            figures["decode_loaded_floor_ms"] = 1e3 * loaded_floor_s
            figures["decode_loaded_ratio"] = _ratio(decode_median_s, loaded_floor_s)
        if engine.kv_store.cache_stats:  # GPU block cache: its size, counters, and the decode steps' hit rate
            looked_up = sum(decode_moved.get(f"cache_{k}_blocks", 0) for k in ("hit", "miss", "overflow"))
            figures["gpu_cache"] = dict(engine.kv_store.cache_stats)
            figures["gpu_cache_gib"] = figures["gpu_cache"]["cache_bytes"] / 2**30
            figures["gpu_cache_hit_rate"] = decode_moved["cache_hit_blocks"] / looked_up if looked_up else None

    prefill_floor_s = flops / (matmul * 1e12 * tp_size) if matmul else None
    decode_hbm_floor_s = dbytes / (hbm * 1e9) if hbm else None
    offloaded = figures["offload"] == "cpu"
    decode_pcie_floor_s = kv_context_bytes / (h2d * 1e9) if (offloaded and h2d) else None
    # a block-selecting policy (or a GPU block cache) loads less than the whole context: its floor is what it loaded
    loaded_or_pcie = decode_pcie_floor_s if loaded_floor_s is None else loaded_floor_s
    binding = [f for f in (decode_hbm_floor_s, loaded_or_pcie) if f]
    decode_floor_s = max(binding) if binding else None
    ms = (lambda seconds: 1e3 * seconds if seconds is not None else None)
    figures.update({
        "weight_bytes": wbytes,
        "kv_bytes_per_token": fl.kv_bytes_per_token(spec, dtype_bytes),
        "prefill_flops": flops,
        # per GPU: the whole model's FLOPs over the time, shared by the N GPUs (held against one GPU's ceiling)
        "prefill_tflops": flops / stats.prefill_seconds / 1e12 / tp_size if stats.prefill_seconds else None,
        "prefill_floor_s": prefill_floor_s,
        "prefill_ratio": _ratio(stats.prefill_seconds, prefill_floor_s),
        "decode_context": decode_context,
        "decode_kv_density": kv_density,  # share of the context's KV a step attends (HBM floor)
        "decode_metadata_bytes_per_step": metadata_bytes,  # a selection's key bounds read per step (HBM floor)
        "decode_bytes_per_step": dbytes,
        "decode_gbps": dbytes / decode_median_s / 1e9 if decode_median_s else None,
        "decode_hbm_floor_ms": ms(decode_hbm_floor_s),
        "decode_pcie_floor_ms": ms(decode_pcie_floor_s),
        "decode_floor_ms": ms(decode_floor_s),
        "decode_ratio": _ratio(decode_median_s, decode_floor_s),
    })

    # decode graphs: capture time and memory (captured at build; offload=cpu captures per KV layout as it goes)
    runner = engine.runner.graph_runner
    figures["graph"] = {**engine.graph_stats, **({"replayed_steps": runner.replayed_steps,
                                                   "eager_steps": runner.eager_steps} if runner else {})}
    figures.update(engine.peak_memory())
    figures.setdefault("gpu_peak_gib", None)
    figures["gpu_build_peak_gib"] = gpu_build_peak_gib
    figures["floors"] = floors

    # ---- HF transformers baseline on the same prompts (task.baseline=true; sparsekv.tasks.bench.baseline owns the code)
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
    path = write_record(cfg, "bench", figures)
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
