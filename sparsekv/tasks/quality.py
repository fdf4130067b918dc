"""task=quality: the configured policy's attention against dense attention (sparsekv.quality).

    python -m sparsekv task=quality policy=minference task.context=32768
    python -m sparsekv -m task=quality policy=quest policy.token_budget=1024,4096       # one run per setting
    python -m sparsekv task=quality model=hf model.path=/ckpt policy=quest task.layers=[0,17,35]

Planted inputs (task.planted): for each seed and needle depth, Q/K/V with sinks, local windows, vertical
stripes and one needle block (sparsekv.quality.planted_inputs) at the configured shapes. With model.path (or
task.model_inputs=true): the checkpoint runs (dense, offload=none) on a needle-in-a-haystack prompt of
task.model_context tokens per seed and depth (sparsekv.tasks.needle.build_haystack), its attention layers'
q/k/v are captured, and the policy is evaluated on them; the needle block is the block(s) holding the needle
sentence. Blocks, chunking and the GPU ring follow task.* or else the offload settings.

Phases (task.phase): decode = compute_chunked_decode; prefill = compute_chunked_prefill (last chunk) and,
with task.resident, compute_prefill (offload=none, whole prompt) as phase "resident"; both = all.
Prints a table and writes quality.json: per-input rows, per-phase means ("summary") and, at the top level,
the primary phase's means (decode if evaluated, else prefill): recall, density, rel_error, needle_* ...
"""
from __future__ import annotations

import copy
import sys
import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm

from sparsekv.config import ResidentOffloadConfig
from sparsekv.plugins import registry

from sparsekv.tasks.common import enum_value, policy_warnings, print_warnings

from sparsekv import quality as ql


def settings(cfg: DictConfig) -> dict[str, Any]:
    """Block size, chunk, ring slots and phases of this run, from task.* or the offload settings."""
    q = cfg.task
    block = int(q.block_size or cfg.offload.block_size)
    chunk = q.prefill_chunk or cfg.offload.get("prefill_chunk_size") or 4 * block
    chunk = int(chunk)
    if block < 1:
        raise ValueError(f"task.block_size={block} must be a positive number of tokens")
    if chunk < block or chunk % block:
        raise ValueError(f"task.prefill_chunk={chunk} must be a positive multiple of the block size {block}")
    slots = int(q.num_gpu_blocks or cfg.offload.get("num_gpu_blocks") or 4)
    if slots < 1:
        raise ValueError(f"task.num_gpu_blocks={slots} must be at least 1")
    phase = enum_value(q.phase)
    phases = {"decode": ["decode"], "prefill": ["prefill"], "both": ["decode", "prefill"]}[phase]
    if "prefill" in phases and q.resident:
        phases.append("resident")
    if not q.depths:
        raise ValueError("task.depths is empty: give at least one needle depth in [0, 1]")
    for depth in q.depths:
        if not 0.0 <= float(depth) <= 1.0:
            raise ValueError(f"task.depths has {depth}: depths are fractions in [0, 1]")
    if not q.seeds:
        raise ValueError("task.seeds is empty: give at least one seed")
    if q.decode_steps < 0:
        raise ValueError(f"task.decode_steps={q.decode_steps} must be 0 or more")
    return {"block_size": block, "prefill_chunk": chunk, "num_gpu_blocks": slots, "phases": phases}


def planted(cfg: DictConfig, s: dict[str, Any], device: torch.device, dtype: torch.dtype) -> list[ql.AttentionInputs]:
    q = cfg.task
    return [ql.planted_inputs(int(q.context), s["block_size"], num_layers=q.num_layers, num_heads=q.num_heads,
                              num_kv_heads=q.num_kv_heads, head_dim=q.head_dim, needle_depths=[float(depth)],
                              prefill_chunk=s["prefill_chunk"], decode_steps=q.decode_steps,
                              sink_tokens=q.sink_tokens, num_stripes=q.num_stripes, local_window=q.local_window,
                              sink_logit=q.sink_logit, stripe_logit=q.stripe_logit, local_logit=q.local_logit,
                              needle_logit=q.needle_logit, dtype=dtype, device=device, seed=int(seed))
            for seed in q.seeds for depth in q.depths]


# ---------------------------------------------------------------------------------------------- checkpoint


def capture_qkv(llm, token_ids: list[int], layers: list[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, list[int]]:
    """Run the prompt through the model (prefill only) and return the attention layers' inputs, on the host:
    q [L, S, H, D], k/v [L, S, KVH, D], the softmax scale and the layer ids."""
    from sparsekv.layers.attention import Attention
    from sparsekv.sampling_params import SamplingParams

    modules = [m for m in llm.engine.model.modules() if isinstance(m, Attention)]
    if layers is not None:
        wanted = {int(i) for i in layers}
        missing = wanted - {m.layer_id for m in modules}
        if missing:
            raise ValueError(f"task.layers {sorted(missing)} do not exist; the model has layers "
                             f"0..{len(modules) - 1}")
        modules = [m for m in modules if m.layer_id in wanted]
    captured: dict[int, list[list[torch.Tensor]]] = {m.layer_id: [[], [], []] for m in modules}

    def hook(module, args):
        for store, tensor in zip(captured[module.layer_id], args[:3]):
            store.append(tensor.detach().to("cpu", copy=True))

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        llm.generate([token_ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), progress=False)
    finally:
        for handle in handles:
            handle.remove()
    ids = sorted(captured)
    q, k, v = (torch.stack([torch.cat(captured[i][j]) for i in ids]) for j in range(3))
    if q.shape[1] != len(token_ids):
        raise RuntimeError(f"captured {q.shape[1]} positions for a prompt of {len(token_ids)} tokens")
    return q, k, v, float(modules[0].scale), ids


def capture_config(cfg: DictConfig, prompt_tokens: int, block_size: int) -> DictConfig:
    """The dense, GPU-resident (offload=none) engine that produces the reference Q/K/V."""
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.policy = OmegaConf.structured(registry().policies["full"]())
        cfg.offload = OmegaConf.structured(ResidentOffloadConfig(
            block_size=block_size, num_kv_blocks=-(-(prompt_tokens + 2) // block_size) + 1))
        cfg.scheduler.max_num_seqs = 1
        if (cfg.scheduler.max_model_len or 0) < prompt_tokens + 2:
            cfg.scheduler.max_model_len = prompt_tokens + 2
        if "graph" in cfg and "mode" in cfg.graph:
            cfg.graph.mode = "eager"  # hooks see eager forwards only
        if "parallel" in cfg:
            cfg.parallel.tensor_parallel_size = 1  # the hooks capture every head in this process
    return cfg


def model_inputs(cfg: DictConfig, s: dict[str, Any], device: torch.device) -> list[ql.AttentionInputs]:
    from sparsekv.llm import LLM
    from sparsekv.models.loader import resolve_spec
    from sparsekv.tasks.needle import build_haystack, sample_key_value
    from sparsekv.tokenizer import load_tokenizer

    q = cfg.task
    spec = resolve_spec(cfg.model)
    context = int(q.model_context or q.context)
    bs = s["block_size"]
    tokenizer = load_tokenizer(cfg.model.path, spec.vocab_size)
    prompts = []  # (seed, depth, token ids, needle token span or None)
    for seed in q.seeds:
        for depth in q.depths:
            if tokenizer is not None:
                key, value = sample_key_value(int(seed), context, float(depth), 0)
                hay = build_haystack(tokenizer.encode, context, float(depth), key, value)
                prompts.append((int(seed), float(depth), hay.token_ids, (hay.needle_start, hay.needle_end)))
            else:  # no tokenizer: random tokens, no needle
                gen = torch.Generator().manual_seed(int(seed))
                ids = torch.randint(0, spec.vocab_size, (context,), generator=gen).tolist()
                prompts.append((int(seed), float(depth), ids, None))
    longest = max(len(p[2]) for p in prompts)
    llm = LLM.from_config(capture_config(cfg, longest, bs))
    captures = []
    try:
        for seed, depth, ids, span in prompts:
            captures.append((seed, depth, span, *capture_qkv(llm, ids, q.layers)))
    finally:
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    inputs = []
    for seed, depth, span, qq, kk, vv, scale, layer_ids in captures:
        S = qq.shape[1]
        lay = ql.layout(S, bs, s["prefill_chunk"], q.decode_steps)
        needles = sorted(set(range(span[0] // bs, (max(span[1], span[0] + 1) - 1) // bs + 1))) if span else []
        meta = {"context": S, "block_size": bs, "depths": [depth], "seed": seed,
                "needle_tokens": list(span) if span else None}
        inputs.append(ql.AttentionInputs(qq, kk, vv, bs, scale, device, needles, S - lay.last_chunk_start,
                                         s["prefill_chunk"], q.decode_steps, layer_ids, "model", meta))
    return inputs


# ---------------------------------------------------------------------------------------------- task


def run(cfg: DictConfig) -> dict:
    from sparsekv.factory import build_policy, resolve_device, resolve_dtype
    from sparsekv.kvcache.host_quant import resolve_host_dtype
    from sparsekv.models.loader import resolve_spec
    from sparsekv.tasks.common import write_record

    q = cfg.task
    s = settings(cfg)
    policy = build_policy(cfg.policy)
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    use_model = q.model_inputs if q.model_inputs is not None else bool(cfg.model.path)
    start = time.perf_counter()
    inputs: list[ql.AttentionInputs] = []
    if q.planted:
        inputs += planted(cfg, s, device, dtype)
    if use_model:
        inputs += model_inputs(cfg, s, device)
    if not inputs:
        raise ValueError("nothing to evaluate: task.planted=false and no model inputs (set model.path or "
                         "task.model_inputs=true)")
    warnings = list(dict.fromkeys(w for x in inputs for w in policy_warnings(
        policy, range(x.num_layers), s["block_size"], x.context)))  # the harness numbers the layers 0..L-1
    print_warnings(warnings)
    # offload=cpu offload.host_dtype=float8_e4m3fn: fp8 host blocks, and their error against model-dtype ones
    host_dtype = resolve_host_dtype(cfg.offload.get("host_dtype", "auto"), dtype, device)
    fp8 = host_dtype != dtype
    reports = []
    for x in tqdm(inputs, desc="quality", unit="input", disable=not q.progress, file=sys.stderr):
        reports.append(ql.evaluate(policy, x, phases=s["phases"], num_gpu_blocks=s["num_gpu_blocks"],
                                   shuffle_blocks=q.shuffle_blocks, probe=q.probe, host_dtype=host_dtype))
    flat = ql.rows(reports)
    summary = ql.summarize(flat, keys=(*ql.SUMMARY_KEYS, "host_kv_rel_error") if fp8 else ql.SUMMARY_KEYS)
    primary = next((p for p in ("decode", "prefill", "resident") if p in summary and "skipped" not in summary[p]),
                   None)
    name = q.label or f"{cfg.model.name} {cfg.policy.name}"
    figures: dict[str, Any] = {
        "name": name,
        "model": cfg.model.name,
        "policy": cfg.policy.name,
        "offload": enum_value(cfg.offload.mode),
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "host_dtype": str(host_dtype).replace("torch.", ""),
        "tensor_parallel_size": 1,  # the harness evaluates attention on one device; model inputs captured at TP=1
        "block_size": s["block_size"],
        "prefill_chunk": s["prefill_chunk"],
        "num_gpu_blocks": s["num_gpu_blocks"],
        "context": int(q.context),
        "phases": s["phases"],
        "primary_phase": primary,
        **(summary[primary] if primary else {}),
        "summary": summary,
        "rows": flat,
        "warnings": warnings,  # the policy selects nothing or everything on this run's shape (tasks.common)
        "wall_seconds": time.perf_counter() - start,
    }
    print(f"quality {name}: policy={cfg.policy.name} on {device}, {figures['dtype']}, block {s['block_size']}, "
          f"chunk {s['prefill_chunk']}, {s['num_gpu_blocks']} GPU slots, phases {', '.join(s['phases'])}")
    columns = ql.TABLE_COLUMNS[:-1] + [("kv_err", "host_kv_rel_error", ".2e")] * fp8 + ql.TABLE_COLUMNS[-1:]
    print(ql.format_table(flat, columns))
    for phase, means in summary.items():
        if "skipped" in means:
            print(f"  {phase}: skipped ({means['skipped']})")
        else:
            print(f"  {phase} mean: " + ", ".join(f"{k} {'-' if v is None else f'{v:.4g}'}" for k, v in means.items()))
    print_warnings(warnings)
    path = write_record(cfg, "quality", figures, resolve_spec(cfg.model) if use_model else None)
    print(f"record: {path}")
    return figures
