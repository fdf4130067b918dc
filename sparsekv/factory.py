"""Assemble model + KV store + policy + runner from a composed config."""
from __future__ import annotations

import logging
import os
import time

import torch
from omegaconf import DictConfig

from sparsekv.config import Device, DType, LoadFormat, OffloadMode
from sparsekv.config_check import build_policy  # noqa: F401 - re-exported: factory.build_policy
from sparsekv.config_check import check_policy_layout
from sparsekv.distributed.engine import DistributedEngine, TensorParallelSampler
from sparsekv.distributed.launch import check_launch, driver_ranks, under_torchrun
from sparsekv.distributed.sharding import check_tensor_parallel, rank_spec
from sparsekv.distributed.state import SINGLE, TensorParallel, all_succeeded, building
from sparsekv.distributed.worker import run_torchrun_worker
from sparsekv.graphs.cuda_graph import attach_graph_runner
from sparsekv.graphs.graph_config import check_graph_config, graph_settings, resolve_graph_mode
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.engine.warm_start import warm_up
from sparsekv.kernels._dispatch import activate_kernels
from sparsekv.kernels.backend import resolve_kernels
from sparsekv.kvcache.base import available_host_memory, format_bytes
from sparsekv.kvcache.host_quant import host_block_bytes, resolve_host_dtype
from sparsekv.kvcache.offload_store import HOST_HEADROOM, OffloadKVStore, host_pool_blocks
from sparsekv.kvcache.paged import PagedKVStore
from sparsekv.kvcache.sizing import (CPU_DEFAULT_MAX_MODEL_LEN, GIB, check_kv_memory, check_whole_prompt_room,
                                    gpu_cache_slots, num_device_kv_blocks, policy_metadata_bytes,
                                    prefill_chunk_tokens, prefill_step_tokens, sequence_blocks)
from sparsekv.models.loader import build_model, model_class, resolve_spec
from sparsekv.models.spec import ModelSpec
from sparsekv.plugins import registry
from sparsekv.policies.context import KVLayout
from sparsekv.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
DTYPES = {DType.float32: torch.float32, DType.float16: torch.float16, DType.bfloat16: torch.bfloat16}


def resolve_device(cfg: DictConfig) -> torch.device:
    if cfg.device == Device.cuda and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    if cfg.device == Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device.value)


def resolve_dtype(cfg: DictConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype != DType.auto:
        return DTYPES[cfg.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_scheduler_config(cfg: DictConfig, spec: ModelSpec, device: torch.device | None = None) -> int:
    """Validate the scheduler keys; returns max_model_len (unset on CPU: at most CPU_DEFAULT_MAX_MODEL_LEN)."""
    scheduler = cfg.scheduler
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if scheduler[key] < 1:
            raise ValueError(f"scheduler.{key}={scheduler[key]} must be at least 1")
    max_model_len = scheduler.max_model_len or spec.max_position_embeddings
    if (not scheduler.max_model_len and device is not None and device.type == "cpu"
            and max_model_len > CPU_DEFAULT_MAX_MODEL_LEN):
        max_model_len = CPU_DEFAULT_MAX_MODEL_LEN
        log.info("device=cpu: scheduler.max_model_len defaults to %d tokens (the model allows %d) to keep the KV "
                 "cache small; set scheduler.max_model_len for longer sequences", max_model_len,
                 spec.max_position_embeddings)
    if max_model_len < 2:
        raise ValueError(f"scheduler.max_model_len={max_model_len} must be at least 2")
    if max_model_len > spec.max_position_embeddings:
        log.warning("scheduler.max_model_len=%d exceeds the model's max_position_embeddings=%d: positions past "
                    "the trained range give unreliable text (fine for speed benchmarks)", max_model_len,
                    spec.max_position_embeddings)
    return max_model_len


def check_offload_config(cfg: DictConfig) -> None:
    offload = cfg.offload
    if offload.block_size < 1:
        raise ValueError(f"offload.block_size={offload.block_size} must be a positive number of tokens")
    if offload.mode == OffloadMode.cpu:
        if offload.num_gpu_blocks < 1:
            raise ValueError(f"offload.num_gpu_blocks={offload.num_gpu_blocks}: the GPU ring needs at least 1 slot "
                             "(2 or more let loads overlap compute)")
        chunk = offload.prefill_chunk_size
        if chunk is not None and (chunk < offload.block_size or chunk % offload.block_size):
            raise ValueError(f"offload.prefill_chunk_size={chunk} must be a positive multiple of "
                             f"offload.block_size={offload.block_size}")


def build_kv_store(cfg: DictConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                   max_model_len: int, policy, tp: TensorParallel = SINGLE):
    """`spec`: one rank's dimensions (rank_spec). With tensor parallelism every rank's store gets the same number
    of blocks (the smallest any rank measured), so every rank schedules the same way."""
    full = registry().policies["full"]()
    prefill_policy = policy if policy.supports_prefill else full
    decode_policy = policy if policy.supports_decode else full
    check_selections = bool(cfg.get("check_selections", False))  # validate device selections too (a sync each)
    if cfg.offload.mode == OffloadMode.none:  # a selecting decode policy chooses among the resident blocks
        prefill_tokens = prefill_step_tokens(cfg, prefill_policy, max_model_len)
        if prefill_tokens != cfg.scheduler.max_num_batched_tokens:
            log.info("policy %s prefills whole prompts: %d prompt tokens per prefill step (scheduler."
                     "max_num_batched_tokens=%d; policy.whole_prompt_prefill=false keeps those chunks)",
                     prefill_policy.name, prefill_tokens, cfg.scheduler.max_num_batched_tokens)
        num_blocks = tp.agree_min(num_device_kv_blocks(cfg, spec, dtype, device, max_model_len, prefill_tokens),
                                  device)
        check_whole_prompt_room(num_blocks, cfg.offload.block_size, max_model_len, prefill_tokens,
                                cfg.scheduler.max_num_batched_tokens, prefill_policy.name)
        store = PagedKVStore(spec.num_hidden_layers, num_blocks, cfg.offload.block_size, spec.num_key_value_heads,
                             spec.head_dim, dtype, device, prefill_policy, max_model_len,
                             decode_policy=decode_policy, check_selections=check_selections,
                             prefill_token_budget=prefill_tokens)
        return store
    offload = cfg.offload
    chunk = prefill_chunk_tokens(cfg, max_model_len)
    initial_prefill_buffer = min(chunk, cfg.scheduler.max_num_batched_tokens)
    host_pool_gib = offload.host_pool_gib
    host_dtype = resolve_host_dtype(offload.host_dtype, dtype, device)
    block_bytes = host_block_bytes(spec.num_hidden_layers, offload.block_size, spec.num_key_value_heads,
                                   spec.head_dim, host_dtype)
    if tp.size > 1:  # each rank's slice of the host pool holds its KV heads
        total = host_pool_gib * GIB if host_pool_gib else 0.9 * available_host_memory() - HOST_HEADROOM
        share = total / tp.size
        blocks = tp.agree_min(max(0, int(share // block_bytes)), device)
        host_pool_gib = (blocks + 0.5) * block_bytes / GIB  # exactly `blocks` blocks (host_pool_blocks rounds down)
    host_blocks = host_pool_blocks(host_pool_gib, block_bytes)
    layout = KVLayout(num_layers=spec.num_hidden_layers, num_kv_heads=spec.num_key_value_heads,
                      head_dim=spec.head_dim, block_size=offload.block_size, max_blocks=host_blocks, dtype=dtype,
                      device=device, expected_blocks=sequence_blocks(cfg, max_model_len, host_blocks))
    cache_slots = gpu_cache_slots(cfg, spec, dtype, device, max_model_len, host_blocks, host_dtype,
                                  policy_metadata_bytes([prefill_policy, decode_policy], layout))
    store = OffloadKVStore(spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim, offload.block_size,
                           offload.num_gpu_blocks, chunk, cfg.scheduler.max_num_seqs, host_pool_gib, dtype,
                           device, prefill_policy, decode_policy, initial_prefill_buffer,
                           check_selections=check_selections, host_dtype=host_dtype,
                           cache_slots_per_layer=cache_slots, expected_blocks=layout.expected_blocks)
    if cache_slots:
        log.info("GPU block cache: %d blocks per layer (%s)", cache_slots, format_bytes(store.engine.cache.bytes))
    if offload.reserve_tokens:
        seconds = store.reserve(offload.reserve_tokens)
        log.info("host KV for %d tokens pinned in %.1f s, kept while idle (offload.reserve_tokens)",
                 offload.reserve_tokens, seconds)
    return store


def check_parallel_config(cfg: DictConfig, spec: ModelSpec, cls: type, device: torch.device) -> int:
    """parallel.tensor_parallel_size against the model and the machine; returns it."""
    size = int(cfg.parallel.tensor_parallel_size) if cfg.get("parallel") is not None else 1
    if size == 1:
        return 1
    check_tensor_parallel(spec, size)
    if LoadFormat(cfg.model.load_format) == LoadFormat.dummy_structured:
        raise ValueError(f"parallel.tensor_parallel_size={size}: model.load_format=dummy_structured plants its "
                         "structure in a whole model; use model.load_format=dummy or parallel.tensor_parallel_size=1")
    if getattr(cls, "supports_tensor_parallel", False) is not True:
        raise ValueError(f"parallel.tensor_parallel_size={size}: architecture {spec.architecture} "
                         f"({cls.__name__}) does not split over ranks; use parallel.tensor_parallel_size=1")
    check_launch(size, device.type)
    return size


def checked_config(cfg: DictConfig) -> tuple:
    """Every check that needs no weights: (spec, model class, policy, device, dtype, tensor_parallel_size,
    max_model_len, graph mode)."""
    spec = resolve_spec(cfg.model)
    cls = model_class(spec, registry().models)
    policy = build_policy(cfg.policy)
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    tp_size = check_parallel_config(cfg, spec, cls, device)
    max_model_len = check_scheduler_config(cfg, spec, device)
    check_offload_config(cfg)
    shard = rank_spec(spec, tp_size)
    check_kv_memory(cfg, shard, dtype, device, max_model_len)
    check_policy_layout(policy, KVLayout(num_layers=shard.num_hidden_layers, num_kv_heads=shard.num_key_value_heads,
                                         head_dim=shard.head_dim, block_size=cfg.offload.block_size, max_blocks=0,
                                         dtype=dtype, device=device))
    graph_cfg = cfg.get("graph")
    check_graph_config(graph_cfg)
    decode_policy = policy if policy.supports_decode else registry().policies["full"]
    graph_mode = resolve_graph_mode(graph_settings(graph_cfg)[0], cfg.offload.mode, device, decode_policy)
    return spec, cls, policy, device, dtype, tp_size, max_model_len, graph_mode


def build_engine(cfg: DictConfig, tp: TensorParallel | None = None) -> LLMEngine:
    """Everything that can fail on bad input is checked before the weights are built (and, with
    parallel.tensor_parallel_size > 1, before any worker starts). `tp`: a worker rank's place (distributed/worker.py);
    rank 0 starts or reuses the workers here and drives them (distributed/engine.py)."""
    try:
        spec, cls, policy, device, dtype, tp_size, max_model_len, graph_mode = checked_config(cfg)
    except Exception as exc:
        if tp is not None:  # a worker: rank 0 passed these checks and waits for this rank's outcome
            all_succeeded(tp, exc)
        raise
    shard_spec = rank_spec(spec, tp_size)  # what one rank computes and stores: the KV store is sized from it
    graph_cfg = cfg.get("graph")
    ranks = None
    if tp_size > 1 and tp is None:
        if under_torchrun() and int(os.environ["RANK"]) != 0:
            run_torchrun_worker(tp_size, device.type)  # serves rank 0's engines, then ends the process
        ranks = driver_ranks(tp_size, device.type)
        engine_id = ranks.new_engine()
        ranks.send("build", cfg)  # the workers build the same engine alongside (their collectives pair with ours)
        tp = ranks.tp
    tp = tp or SINGLE
    if device.type == "cuda" and tp.size > 1:
        device = torch.device("cuda", tp.local_rank)
    torch.manual_seed(cfg.seed)
    kernels = resolve_kernels(device)  # every backend and fusion choice, once
    activate_kernels(device, kernels)  # what the KV store, the policies and plugins' kernel calls run
    error = None
    start, weights = time.perf_counter(), 0.0
    try:
        with building(tp):  # the model's layers take this rank's heads, columns and vocabulary rows
            model = build_model(cfg.model, spec, cls, device, dtype, cfg.seed, kernels=kernels)
        weights = _synchronized(device, start)
        tokenizer = load_tokenizer(cfg.model.path, spec.vocab_size)
    except Exception as exc:
        if tp.size == 1:
            raise
        error = exc
    if tp.size > 1:
        all_succeeded(tp, error)  # a checkpoint that loads on no rank fails on rank 0 with its own message
    start = time.perf_counter()
    kv_store = build_kv_store(cfg, shard_spec, dtype, device, max_model_len, policy, tp)
    kv = _synchronized(device, start)
    log.info("built %s on %s (%s), offload=%s: %d KV blocks of %d tokens%s", spec.architecture, device, dtype,
             cfg.offload.mode.value, kv_store.num_blocks, cfg.offload.block_size,
             f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else "")
    engine_cls = DistributedEngine if ranks is not None else LLMEngine
    engine = engine_cls(cfg, spec, model, kv_store, tokenizer, device, dtype, max_model_len, policy)
    engine.startup.update(weights_seconds=weights, kv_seconds=kv)
    if ranks is not None:
        engine.attach(ranks, engine_id)
    if tp.size > 1:
        engine.runner.sampler = TensorParallelSampler(tp)
    attach_graph_runner(engine, graph_mode, graph_cfg)  # after the KV pools, before the first decode
    # kernels compile and batch size 1's graph is captured here, not in a request; tensor-parallel ranks would each
    # run it on their own while rank 0 also mirrors its calls to them, so they start cold
    if device.type == "cuda" and tp.size == 1:
        warm_up(engine, kernels, graph_mode, graph_cfg)  # a cold process compiles its kernels in parallel first
    return engine


def _synchronized(device: torch.device, start: float) -> float:
    """Seconds since `start` once the device's queued work (weight fills, KV zeroing) is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
