"""How much KV memory goes where: the device KV pool (offload=none), the checks against the machine before any
weights load, the prefill chunk, and with offload=cpu the GPU block cache, sized after the policies' block
metadata (SparsePolicy.device_bytes_per_block) has been set aside."""
from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig

from sparsekv.config import OffloadMode, PrefillMode, parse_gpu_cache_gib
from sparsekv.config_check import policy_origin
from sparsekv.errors import PolicyConfigError
from sparsekv.kvcache.base import available_host_memory, format_bytes
from sparsekv.kvcache.host_quant import host_block_bytes, resolve_host_dtype
from sparsekv.kvcache.offload_store import HOST_HEADROOM, host_pool_blocks
from sparsekv.models.spec import MLP_SLICE_TOKENS, ModelSpec
from sparsekv.policies.context import KVLayout

log = logging.getLogger(__name__)

CPU_DEFAULT_MAX_MODEL_LEN = 8192  # the prompt is unknown when the KV pool is sized: a modest default on CPU
CPU_KV_FRACTION = 0.5  # of MemAvailable; the rest for weights, activations and everything else on the machine
CPU_KV_POOL_CAP = 2 << 30  # the automatic CPU pool stops here unless one max_model_len sequence needs more
GIB = 1 << 30


def kv_block_bytes(cfg: DictConfig, spec: ModelSpec, dtype: torch.dtype) -> int:
    return spec.kv_bytes_per_token * cfg.offload.block_size * dtype.itemsize


def prefill_activation_bytes(tokens: int, spec: ModelSpec, dtype: torch.dtype) -> int:
    """Device bytes of the activations one prefill step of `tokens` tokens holds at its peak (hidden, q/k/v, and
    the MLP's, which takes at most MLP_SLICE_TOKENS tokens at a time)."""
    mlp = min(tokens, MLP_SLICE_TOKENS) * 4 * spec.intermediate_size
    return (mlp + tokens * (8 * spec.hidden_size + 6 * spec.num_attention_heads * spec.head_dim)) * dtype.itemsize


def prefill_step_tokens(cfg: DictConfig, prefill_policy, max_model_len: int) -> int:
    """offload=none: prompt tokens one prefill step may compute: scheduler.max_num_batched_tokens, or at least
    max_model_len (a whole prompt) for a policy with whole_prompt_prefill (SparsePolicy)."""
    budget = int(cfg.scheduler.max_num_batched_tokens)
    whole = getattr(prefill_policy, "whole_prompt_prefill", False)
    if not isinstance(whole, bool):
        raise ValueError(f"policy {getattr(prefill_policy, 'name', prefill_policy)!r} sets whole_prompt_prefill="
                         f"{whole!r}; the policy must set it to True or False")
    return max(budget, max_model_len) if whole else budget


def check_whole_prompt_room(num_blocks: int, block_size: int, max_model_len: int, prefill_tokens: int,
                            budget: int, policy_name: str) -> None:
    """offload=none: a whole-prompt prefill step must leave the KV pool room for one max_model_len sequence."""
    if prefill_tokens > budget and num_blocks * block_size < max_model_len:
        raise ValueError(f"policy {policy_name!r} prefills whole prompts of up to scheduler.max_model_len="
                         f"{max_model_len} tokens in one step, and that step's activations leave the KV cache "
                         f"{num_blocks * block_size} tokens, less than one sequence; set policy.whole_prompt_prefill="
                         "false (prefill in scheduler.max_num_batched_tokens chunks), lower scheduler.max_model_len "
                         "or use offload=cpu")


def num_device_kv_blocks(cfg: DictConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                         max_model_len: int, prefill_tokens: int) -> int:
    """Room for max_num_seqs sequences of max_model_len tokens, capped by the memory left after the weights and a
    prefill step of prefill_tokens on CUDA (gpu_memory_utilization) and by CPU_KV_POOL_CAP on CPU. A set
    offload.num_kv_blocks is taken as it is, after a check on CUDA that it fits beside that prefill step."""
    offload = cfg.offload
    block_bytes = kv_block_bytes(cfg, spec, dtype)
    if offload.num_kv_blocks:
        blocks = int(offload.num_kv_blocks)
        if device.type == "cuda":  # the blocks and the largest prefill step must fit beside the weights
            free = torch.cuda.mem_get_info(device)[0]
            activations = prefill_activation_bytes(prefill_tokens, spec, dtype)
            if blocks * block_bytes + activations > free:
                raise ValueError(
                    f"offload.num_kv_blocks={blocks} ({format_bytes(blocks * block_bytes)} of KV cache) and a "
                    f"prefill step of {prefill_tokens} tokens (about {format_bytes(activations)} of activations) do "
                    f"not fit the {format_bytes(free)} of device memory free after the weights; lower "
                    "offload.num_kv_blocks or scheduler.max_model_len, set policy.whole_prompt_prefill=false where "
                    "the policy prefills whole prompts, or use offload=cpu")
        return blocks
    per_seq = -(-max_model_len // offload.block_size)
    wanted = cfg.scheduler.max_num_seqs * per_seq
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        activations = prefill_activation_bytes(prefill_tokens, spec, dtype) + (1 << 30)
        budget = total * offload.gpu_memory_utilization - used - activations
        return max(1, min(wanted, int(budget // block_bytes)))
    # CPU: check_kv_memory has made sure one full-length sequence fits, before the weights loaded
    cap = max(per_seq, int(CPU_KV_POOL_CAP // block_bytes))
    if wanted > cap:
        log.info("device=cpu: the KV cache holds %d blocks (%s): full-length (%d-token) sequences at once: %d, "
                 "not scheduler.max_num_seqs=%d; set offload.num_kv_blocks for more", cap,
                 format_bytes(cap * block_bytes), max_model_len, cap // per_seq, cfg.scheduler.max_num_seqs)
    return min(wanted, cap)


def check_kv_memory(cfg: DictConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                    max_model_len: int) -> None:
    """The KV cache the config asks for against the machine's memory, before any weights load."""
    offload = cfg.offload
    block_bytes = kv_block_bytes(cfg, spec, dtype)
    available = available_host_memory()
    if offload.mode == OffloadMode.cpu:
        block_bytes = host_block_bytes(spec.num_hidden_layers, offload.block_size, spec.num_key_value_heads,
                                       spec.head_dim, resolve_host_dtype(offload.host_dtype, dtype, device))
        if not available:
            return
        if offload.host_pool_gib is not None and offload.host_pool_gib * GIB > available:
            raise ValueError(f"offload.host_pool_gib={offload.host_pool_gib:g} exceeds the {format_bytes(available)} "
                             "of available host memory; lower it or leave it unset (auto)")
        if offload.host_pool_gib is None and 0.9 * available - HOST_HEADROOM < block_bytes:
            raise ValueError(f"the automatic host KV pool (90% of available host memory less "
                             f"{format_bytes(HOST_HEADROOM)}) is empty with {format_bytes(available)} available; "
                             "free host memory or set offload.host_pool_gib")
        ranks = int(cfg.parallel.tensor_parallel_size) if cfg.get("parallel") is not None else 1
        pool_tokens = host_pool_blocks(offload.host_pool_gib, block_bytes) // ranks * offload.block_size
        if offload.reserve_tokens > pool_tokens:
            raise ValueError(f"offload.reserve_tokens={offload.reserve_tokens} exceeds the host KV pool's "
                             f"{pool_tokens} tokens; lower it or raise offload.host_pool_gib")
        return
    if device.type == "cuda":
        limit, where = torch.cuda.mem_get_info(device)[1] * offload.gpu_memory_utilization, "device memory"
    else:
        limit, where = available, "available host memory"
    if not limit:
        return
    if offload.num_kv_blocks:
        need = offload.num_kv_blocks * block_bytes
        if need > limit:
            raise ValueError(f"offload.num_kv_blocks={offload.num_kv_blocks} needs {format_bytes(need)} of KV cache "
                             f"but only {format_bytes(limit)} of {where} is there; lower it or leave it unset (auto)")
        return
    per_seq_bytes = -(-max_model_len // offload.block_size) * block_bytes
    if device.type == "cpu" and per_seq_bytes > available * CPU_KV_FRACTION:
        raise ValueError(f"scheduler.max_model_len={max_model_len} needs {format_bytes(per_seq_bytes)} of KV cache "
                         f"for one sequence but only {format_bytes(available * CPU_KV_FRACTION)} (half of the "
                         f"{format_bytes(available)} of available host memory) can hold the KV cache; lower "
                         "scheduler.max_model_len")
    if device.type == "cuda" and per_seq_bytes > limit:
        raise ValueError(f"scheduler.max_model_len={max_model_len} needs {format_bytes(per_seq_bytes)} of KV cache "
                         f"for one sequence but only {format_bytes(limit)} of {where} is there; lower "
                         "scheduler.max_model_len or use offload=cpu")


def prefill_chunk_tokens(cfg: DictConfig, max_model_len: int) -> int:
    offload = cfg.offload
    if offload.prefill_mode == PrefillMode.layerwise:
        return max_model_len  # the whole prompt in one pass per layer
    chunk = offload.prefill_chunk_size or cfg.scheduler.max_num_batched_tokens
    return max(offload.block_size, chunk - chunk % offload.block_size)


GPU_CACHE_MARGIN = 2 * GIB  # device memory gpu_cache_gib=auto leaves free (graphs, allocator slack, kernels)


def sequence_blocks(cfg: DictConfig, max_model_len: int, host_blocks: int) -> int:
    """Host blocks the scheduler's sequences can hold at once: max_num_seqs full-length sequences, at most the
    pool. Ids are handed out lowest first (BlockManager), so no id in use reaches it."""
    return min(host_blocks, cfg.scheduler.max_num_seqs * -(-max_model_len // cfg.offload.block_size))


def policy_metadata_bytes(policies: list, layout: KVLayout) -> tuple[int, str]:
    """Device bytes per host block of the policies' metadata (SparsePolicy.device_bytes_per_block), checked, and
    the policies that keep any, named as errors name them."""
    total, owners = 0, []
    for policy in {id(p): p for p in policies}.values():
        value = policy.device_bytes_per_block(layout)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PolicyConfigError(f"{policy_origin(policy.name)}: {type(policy).__name__}.device_bytes_per_block "
                                    f"returned {value!r}; it must return the device bytes its metadata keeps per "
                                    "host block, all layers, as an int >= 0")
        total += value
        if value:
            owners.append(policy_origin(policy.name))
    return total, ", ".join(owners)


def gpu_cache_slots(cfg: DictConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                    max_model_len: int, host_blocks: int, host_dtype: torch.dtype | None = None,
                    metadata: tuple[int, str] = (0, "")) -> int:
    """Slots per layer of the GPU block cache (offload.gpu_cache_gib): auto is the device memory left after the
    weights (loaded by now), the ring, the prefill and decode buffers, the activations and the policies' block
    metadata (`metadata`: policy_metadata_bytes, for every block the sequences can hold), less GPU_CACHE_MARGIN,
    on CUDA, and no cache on a CPU device; never more than the host pool or max_num_seqs full-length sequences
    can use. Blocks are counted as the host holds them (`host_dtype`, default the model's: fp8 bytes plus scales
    with the fp8 host tier), which is how the cache and the ring hold them."""
    offload = cfg.offload
    gib = parse_gpu_cache_gib(offload.get("gpu_cache_gib", "auto"))
    layers = spec.num_hidden_layers
    block_bytes = host_block_bytes(layers, offload.block_size, spec.num_key_value_heads, spec.head_dim,
                                   host_dtype or dtype) // layers  # K and V of one block of one layer
    useful = sequence_blocks(cfg, max_model_len, host_blocks)
    reserve = useful * metadata[0]
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    if reserve and device.type == "cuda" and reserve > free - GPU_CACHE_MARGIN:
        raise ValueError(f"{metadata[1]} keeps {format_bytes(reserve)} of block metadata on the device for "
                         f"{useful} host blocks (scheduler.max_num_seqs={cfg.scheduler.max_num_seqs} x "
                         f"scheduler.max_model_len={max_model_len}), more than the {format_bytes(free)} free after "
                         "the weights; lower scheduler.max_model_len or scheduler.max_num_seqs")
    free -= reserve
    if gib is None:
        if device.type != "cuda":
            return 0
        token_bytes = spec.kv_bytes_per_token * dtype.itemsize
        buffers = (offload.num_gpu_blocks * block_bytes + (prefill_chunk_tokens(cfg, max_model_len)
                   + cfg.scheduler.max_num_seqs * offload.block_size) * token_bytes)
        activations = prefill_activation_bytes(cfg.scheduler.max_num_batched_tokens, spec, dtype)
        gib = max(0.0, (free - buffers - activations - GPU_CACHE_MARGIN) / GIB)
    elif device.type == "cuda" and gib * GIB > free:
        held = f" and the policies' block metadata ({format_bytes(reserve)})" if reserve else ""
        raise ValueError(f"offload.gpu_cache_gib={gib:g} exceeds the {format_bytes(free)}"
                         f" of free device memory after the weights{held}; lower it, or use auto")
    slots = min(useful, int(gib * GIB // (layers * block_bytes)))
    return slots if slots >= 1 else 0
