"""Physical limits the benchmarks report against: measured device ceilings and the arithmetic of a model.

Measured ceilings (CUDA only; each returns None on a CPU device): dense GEMM rate, HBM copy bandwidth,
pinned host<->device copy bandwidth. Each is timed with CUDA events after a warm-up, on fresh random data
(never zeros: some GPUs move and multiply zeros faster), and the median of several repeats is reported.

Pure functions (no device, unit-tested on CPU): FLOPs of a prefill, bytes a decode step must read (a
block-selecting policy's selected KV and key bounds only), KV bytes per token, bytes of a model's weights. A figure's
floor is work / measured rate; a benchmark reports achieved time / floor time (>= 1; 1 means at the physical limit).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import math
import statistics
from typing import Callable

import torch
from torch import nn

GIB = 1 << 30

# ---------------------------------------------------------------------------------------------- arithmetic


def _itemsize(dtype_bytes: int | float | torch.dtype) -> float:
    return dtype_bytes.itemsize if isinstance(dtype_bytes, torch.dtype) else dtype_bytes


def kv_bytes_per_token(spec, dtype_bytes: int | torch.dtype = 2) -> int:
    """K and V of one token in all layers: layers x 2 x kv_heads x head_dim x dtype bytes (Qwen3-4B bf16: 144 KiB)."""
    return int(spec.num_hidden_layers * 2 * spec.num_key_value_heads * spec.head_dim * _itemsize(dtype_bytes))


def kv_element_bytes(dtype: torch.dtype, host_dtype: str = "auto", block_size: int = 1, head_dim: int = 1) -> float:
    """Bytes of one K or V element as the KV cache stores it: the model dtype's, or with offload.host_dtype=
    float8_e4m3fn one byte plus its share of the float32 scale of its (block, KV head)."""
    if host_dtype == "float8_e4m3fn":  # also config.HostDType.float8_e4m3fn, a str enum
        return 1 + 4 / (block_size * head_dim)
    return dtype.itemsize


def per_gpu_spec(spec, tensor_parallel_size: int = 1):
    """The dimensions one GPU of a tensor-parallel run holds (its attention heads, KV heads, MLP columns). Per GPU:
    the HBM floor reads weights/N + KV/N bytes a step (the weights as the rank's model counts them). The PCIe floor
    of offloaded decode is the whole KV over the ranks' summed H2D bandwidth (aggregate_h2d_gbps: each GPU loads
    its heads' KV/N on its own link); the prefill floor divides the FLOPs by N GPUs' GEMM rate."""
    from sparsekv.distributed.sharding import rank_spec

    return rank_spec(spec, tensor_parallel_size)


def linear_params_per_token(spec) -> int:
    """Weights of the linear layers every token goes through (q, k, v, o, gate, up, down in every layer),
    without the embedding and the lm_head."""
    h, heads, kv_heads, d = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    attn = h * heads * d + 2 * h * kv_heads * d + heads * d * h
    mlp = 3 * h * spec.intermediate_size
    return spec.num_hidden_layers * (attn + mlp)


def param_count(spec) -> int:
    """All parameters of a Llama/Qwen3-style model (embedding once when tied; norms included)."""
    h, d = spec.hidden_size, spec.head_dim
    embed = spec.vocab_size * h
    norms = spec.num_hidden_layers * 2 * h + h
    if getattr(spec, "architecture", "").startswith("Qwen3"):
        norms += spec.num_hidden_layers * 2 * d  # q_norm, k_norm
    lm_head = 0 if spec.tie_word_embeddings else spec.vocab_size * h
    return linear_params_per_token(spec) + embed + lm_head + norms


def prefill_flops(spec, context: int, chunked: bool | int = False, batch: int = 1) -> float:
    """FLOPs to prefill `batch` prompts of `context` tokens.

    Linear layers: 2 x linear params x tokens, plus the lm_head (2 x hidden x vocab) for the last token only.
    Attention (QK^T and PV, causal): 2 x 2 x layers x heads x head_dim x context^2 / 2.
    `chunked`: a prefill chunk size (True: 256). Chunked prefill that computes each chunk's diagonal square
    densely (masked, not skipped) does context x chunk / 2 more attention work per layer and head; the default
    (False) is the ideal causal count, the floor.
    """
    linear = 2.0 * linear_params_per_token(spec) * context + 2.0 * spec.hidden_size * spec.vocab_size
    pairs = context * context / 2.0
    if chunked:
        chunk = 256 if chunked is True else int(chunked)
        pairs += context * min(chunk, context) / 2.0
    attention = 2.0 * 2.0 * spec.num_hidden_layers * spec.num_attention_heads * spec.head_dim * pairs
    return batch * (linear + attention)


def decode_bytes(spec, context: int, batch: int, dtype_bytes: int | float | torch.dtype, weight_bytes: float,
                 kv_density: float = 1.0, metadata_bytes: float = 0.0) -> float:
    """Bytes one decode step must read at least: the weights once, plus the KV of `context` tokens for each of
    the `batch` sequences scaled by `kv_density` (the share of the context's KV a selecting policy attends), plus
    the policy's per-step `metadata_bytes` (all sequences)."""
    kv = batch * context * kv_bytes_per_token(spec, dtype_bytes) * kv_density
    return float(weight_bytes) + kv + float(metadata_bytes)


def budgeted_selection(context: int, block_size: int, num_layers: int, budget_blocks: int, dense_layers: int = 0,
                       threshold_blocks: int = 0) -> tuple[float, int]:
    """(KV tokens a sequence of `context` tokens attends per layer in one decode step, averaged over the layers;
    the number of layers that select) under a budgeted block selection (common.BudgetedSelection, e.g. quest).
    The unfinished block's tokens are always attended; of the full blocks before them a selecting layer attends
    `budget_blocks`, the first `dense_layers` layers all. No layer selects when the full blocks number at most
    the budget or `threshold_blocks`."""
    full = (context - 1) // block_size  # the blocks before the one holding the token being computed
    tail = context - full * block_size
    selects = full > budget_blocks and full > threshold_blocks
    selecting = max(0, num_layers - dense_layers) if selects else 0
    attended = (num_layers - selecting) * full + selecting * budget_blocks
    return tail + block_size * attended / num_layers, selecting


def block_bounds_bytes(spec, context: int, block_size: int, batch: int, selecting_layers: int,
                       dtype_bytes: int | torch.dtype = 2) -> float:
    """Bytes of per-block key bounds a bounds-scoring selection (quest: a minimum and a maximum key per KV head
    and channel) reads per decode step: every full block of every selecting layer, for each sequence."""
    full = (context - 1) // block_size
    per_block = 2 * spec.num_key_value_heads * spec.head_dim * _itemsize(dtype_bytes)
    return float(batch * selecting_layers * full * per_block)


def weight_bytes(model: nn.Module, skip_untied_embedding: bool = False) -> int:
    """Bytes of a model's parameters, each shared tensor counted once.

    skip_untied_embedding: leave out embedding tables that no linear layer shares (a decode step reads one
    row of them per token, not the table); a tied embedding is read whole by the lm_head and stays in.
    """
    linear_ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Linear)}
    skip = set()
    if skip_untied_embedding:
        skip = {m.weight.data_ptr() for m in model.modules()
                if isinstance(m, nn.Embedding) and m.weight.data_ptr() not in linear_ptrs}
    seen, total = set(), 0
    for param in model.parameters():
        ptr = param.data_ptr()
        if ptr in seen or ptr in skip:
            continue
        seen.add(ptr)
        total += param.numel() * param.element_size()
    return total


# ---------------------------------------------------------------------------------------------- measured


def _is_cuda(device) -> bool:
    device = torch.device(device) if device is not None else None
    return device is not None and device.type == "cuda" and torch.cuda.is_available()


def cuda_median_seconds(fn: Callable[[], None], warmup: int = 3, repeats: int = 7, inner: int = 1,
                         warmup_seconds: float = 0.0) -> float:
    """Median over `repeats` of the CUDA-event time of `inner` back-to-back calls, divided by `inner`, after
    `warmup` calls and, with warmup_seconds, after keeping the device busy that long (clocks settle)."""
    import time

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_seconds:
        for _ in range(max(1, inner)):
            fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def _release() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def matmul_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 8192, device="cuda",
                  warmup_seconds: float = 0.5) -> float | None:
    """Dense n x n x n GEMM rate in TFLOP/s (2 n^3 FLOPs per product), sustained: timed after `warmup_seconds`
    of GEMMs, once the SM clock has settled under the board's power limit. (A burst from an idle GPU runs at
    boost clock, ~12% faster on an H200: 790 vs 700 TFLOP/s; a prefill of more than a fraction of a second
    runs at the sustained rate.)"""
    if not _is_cuda(device):
        return None
    with torch.no_grad():
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        c = torch.empty(n, n, device=device, dtype=dtype)
        seconds = cuda_median_seconds(lambda: torch.matmul(a, b, out=c), warmup=5, repeats=7, inner=10,
                                        warmup_seconds=warmup_seconds)
        del a, b, c
    _release()
    return 2.0 * n ** 3 / seconds / 1e12


def hbm_gbps(nbytes: int = 2 * GIB, device="cuda") -> float | None:
    """Device-to-device copy bandwidth in GB/s, counting the bytes read plus the bytes written."""
    if not _is_cuda(device):
        return None
    numel = nbytes // 4
    src = torch.rand(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = cuda_median_seconds(lambda: dst.copy_(src), warmup=3, repeats=7, inner=5)
    del src, dst
    _release()
    return 2.0 * numel * 4 / seconds / 1e9


def _host_buffer(numel: int, pinned: bool, fill_from: torch.Tensor | None = None) -> torch.Tensor:
    host = torch.empty(numel, dtype=torch.float32, pin_memory=pinned)
    if fill_from is not None:
        host.copy_(fill_from)  # random bytes, drawn on the device (fast) and brought over once
    return host


def h2d_gbps(pinned: bool = True, nbytes: int = GIB, device="cuda") -> float | None:
    """Host-to-device copy bandwidth in GB/s (bytes moved / time), from pinned (default) or pageable memory."""
    if not _is_cuda(device):
        return None
    numel = nbytes // 4
    dst = torch.rand(numel, device=device, dtype=torch.float32)
    src = _host_buffer(numel, pinned, fill_from=dst)
    dst.zero_()
    repeats = 5 if pinned else 3
    seconds = cuda_median_seconds(lambda: dst.copy_(src, non_blocking=pinned), warmup=2, repeats=repeats)
    del dst, src
    _release()
    return numel * 4 / seconds / 1e9


def d2h_gbps(pinned: bool = True, nbytes: int = GIB, device="cuda") -> float | None:
    """Device-to-host copy bandwidth in GB/s into pinned (default) or pageable memory."""
    if not _is_cuda(device):
        return None
    numel = nbytes // 4
    src = torch.rand(numel, device=device, dtype=torch.float32)
    dst = _host_buffer(numel, pinned)
    repeats = 5 if pinned else 3
    seconds = cuda_median_seconds(lambda: dst.copy_(src, non_blocking=pinned), warmup=2, repeats=repeats)
    del dst, src
    _release()
    return numel * 4 / seconds / 1e9


RANK_H2D_BYTES = GIB // 4  # per rank, measured while every rank copies: enough for a steady rate


def _rank_h2d(tp, nbytes: int) -> list[float | None]:
    """On every rank at once (Ranks.call): this rank's pinned H2D rate on its own GPU, started together after a
    barrier so the copies share the host's memory and root complex as the ranks' KV loads do; every rank's figure
    gathered. Never raises (a worker that raised would end): a failed measurement is None."""
    import torch.distributed as dist

    gbps: float | None = None
    try:
        dist.barrier(group=tp.control)
        gbps = h2d_gbps(pinned=True, nbytes=nbytes, device=torch.device("cuda", tp.local_rank))
    except Exception:  # noqa: BLE001 - reported as a missing figure
        gbps = None
    gathered: list[float | None] = [None] * tp.size
    dist.all_gather_object(gathered, gbps, group=tp.control)
    return gathered


def ranks_h2d_gbps(tensor_parallel_size: int, device_type: str, nbytes: int = RANK_H2D_BYTES
                   ) -> list[float | None] | None:
    """Each rank's pinned H2D GB/s, measured concurrently on the run's tensor-parallel ranks (started here, reused
    by the engine build); rank r's figure at [r]. None on CPU, with one rank, or on a torchrun rank other than 0
    (it joins rank 0's measurement from build_engine)."""
    import os

    from sparsekv.distributed.launch import check_launch, driver_ranks, under_torchrun

    if device_type != "cuda" or tensor_parallel_size < 2 or not torch.cuda.is_available():
        return None
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return None
    check_launch(tensor_parallel_size, device_type)
    return driver_ranks(tensor_parallel_size, device_type).call(_rank_h2d, nbytes)


def aggregate_h2d_gbps(h2d_gbps: float | None, per_rank: list[float | None] | None,
                       tensor_parallel_size: int = 1) -> float | None:
    """The H2D rate the ranks' KV loads share: the sum of the per-rank figures measured together when every rank
    has one, else one GPU's rate x N (each GPU on its own link)."""
    if per_rank and len(per_rank) == tensor_parallel_size and all(g is not None for g in per_rank):
        return float(sum(per_rank))
    return h2d_gbps * tensor_parallel_size if h2d_gbps is not None else None


def measure_floors(device="cuda", dtype: torch.dtype = torch.bfloat16, pageable: bool = True) -> dict:
    """All measured ceilings of `device` plus what they were measured on. On a CPU device the figures are None.

    Keys: device, gpu_name, torch_version, cuda_version, date, matmul_dtype, matmul_tflops, hbm_gbps,
    h2d_gbps, d2h_gbps, h2d_pageable_gbps (None unless pageable), measure_seconds.
    """
    import time

    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = _is_cuda(device)
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    floors = {
        "device": str(device),
        "gpu_name": torch.cuda.get_device_name(device) if cuda else None,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "matmul_dtype": str(dtype).replace("torch.", ""),
    }
    start = time.perf_counter()
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        floors["matmul_tflops"] = matmul_tflops(dtype, device=device)
        floors["hbm_gbps"] = hbm_gbps(device=device)
        floors["h2d_gbps"] = h2d_gbps(pinned=True, device=device)
        floors["d2h_gbps"] = d2h_gbps(pinned=True, device=device)
        floors["h2d_pageable_gbps"] = h2d_gbps(pinned=False, device=device) if pageable else None
    floors["measure_seconds"] = time.perf_counter() - start
    for key in ("matmul_tflops", "hbm_gbps", "h2d_gbps", "d2h_gbps", "h2d_pageable_gbps"):
        value = floors[key]
        if value is not None and not math.isfinite(value):
            floors[key] = None
    return floors


if __name__ == "__main__":  # python -m sparsekv.tasks.bench.floors: print this machine's ceilings
    import json

    print(json.dumps(measure_floors("cuda" if torch.cuda.is_available() else "cpu"), indent=2))
