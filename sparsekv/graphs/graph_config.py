"""The `graph` config of decode steps: which graph mode a run uses (resolve_graph_mode), the config node's settings
(graph_settings, check_graph_config) and the batch sizes whose decode graphs may be captured (capture_batch_sizes).
The runners that capture and replay the graphs are in sparsekv/graphs/cuda_graph.py.
"""
from __future__ import annotations

from typing import Any

import torch

from sparsekv.config import GraphMode, OffloadMode

LADDER = (1, 2, 4, 8)  # then steps of LADDER_STEP
LADDER_STEP = 16


def capture_batch_sizes(max_batch_size: int, batch_sizes=None) -> list[int]:
    """The batch sizes to capture: `batch_sizes` when given, else 1, 2, 4, 8, 16, 32, ... up to and including
    max_batch_size (which is added when the ladder skips it)."""
    if batch_sizes:
        sizes = sorted({int(b) for b in batch_sizes})
        if sizes[0] < 1:
            raise ValueError(f"graph.batch_sizes={list(batch_sizes)}: every batch size must be at least 1")
        return sizes
    if max_batch_size < 1:
        raise ValueError(f"graph.max_batch_size={max_batch_size} must be at least 1")
    sizes = {b for b in LADDER if b <= max_batch_size}
    sizes.update(range(LADDER_STEP, max_batch_size + 1, LADDER_STEP))
    sizes.add(max_batch_size)
    return sorted(sizes)


def as_enum(value, cls):
    """value as a member of the enum cls (a member already, another enum's member of the same value, or a string)."""
    return value if isinstance(value, cls) else cls(getattr(value, "value", value))


def resolve_graph_mode(mode, offload, device: torch.device, decode_policy=None) -> GraphMode:
    """The decode mode a run uses; a mode the run cannot use is a ValueError that names graph.mode and the fix.

    auto on CUDA: cudagraph when the Triton kernels are in use and the decode policy allows captured steps
    (offloaded: SparsePolicy.decode_graph_safe; resident with a block-selecting policy: paged_device_selection too),
    else segmented; eager without CUDA.
    """
    from sparsekv.kernels._dispatch import ENV_BACKEND, use_triton

    mode, offload = as_enum(mode, GraphMode), as_enum(offload, OffloadMode)
    graph_safe = getattr(decode_policy, "decode_graph_safe", True)
    offloaded = offload == OffloadMode.cpu
    # offload=none: a selecting decode policy builds each step's block table on the host (paged_selection), unless
    # it chooses for the whole batch on the device (SparsePolicy.paged_device_selection): that step is capturable
    device_choice = graph_safe and getattr(decode_policy, "paged_device_selection", False)
    paged_selecting = not offloaded and getattr(decode_policy, "requires_block_selection", False) \
        and not device_choice
    if mode == GraphMode.eager:
        return mode
    if device.type != "cuda":
        if mode == GraphMode.auto:
            return GraphMode.eager
        raise ValueError(f"graph.mode={mode.value} needs a CUDA device, but this run is on {device.type}: CUDA graphs "
                         "replay captured GPU kernels. Use graph=eager, or graph=auto (eager without CUDA)")
    if mode == GraphMode.cudagraph and paged_selecting:
        raise ValueError(f"graph.mode=cudagraph replays captured decode steps, but with offload=none policy="
                         f"{getattr(decode_policy, 'name', decode_policy)} selects blocks per step on the host; use "
                         "graph=segmented or graph=auto, or offload=cpu")
    triton = use_triton(device)  # the torch references of the decode kernels sync with the host: not capturable
    if mode == GraphMode.auto:
        return GraphMode.cudagraph if triton and (graph_safe or not offloaded) and not paged_selecting \
            else GraphMode.segmented
    if mode == GraphMode.cudagraph and not triton:
        raise ValueError(f"graph.mode=cudagraph needs the Triton decode kernels, but the attention backend is "
                         f"the torch reference (triton missing, or {ENV_BACKEND}=torch), which syncs with the host; "
                         "install triton / unset the variable, or use graph=segmented (attention stays eager)")
    if mode == GraphMode.cudagraph and offloaded and not graph_safe:
        raise ValueError(f"graph.mode=cudagraph replays captured decode steps, but policy="
                         f"{getattr(decode_policy, 'name', decode_policy)} sets decode_graph_safe=False (its block "
                         "choice depends on per-token host state); use graph=segmented or graph=auto")
    return mode


def graph_settings(graph_cfg) -> tuple[Any, int | None, list[int] | None]:
    """(mode, max_batch_size, batch_sizes) of a `graph` config node (a missing node means auto)."""
    if graph_cfg is None:
        return GraphMode.auto, None, None
    get = graph_cfg.get if hasattr(graph_cfg, "get") else (lambda key, default=None: getattr(graph_cfg, key, default))
    max_batch = get("max_batch_size", None)
    sizes = get("batch_sizes", None)
    return get("mode", GraphMode.auto), (int(max_batch) if max_batch is not None else None), \
        ([int(b) for b in sizes] if sizes else None)


def check_graph_config(graph_cfg) -> None:
    _, max_batch, sizes = graph_settings(graph_cfg)
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"graph.max_batch_size={max_batch} must be at least 1 (larger decode batches run eagerly)")
    if sizes is not None:
        capture_batch_sizes(1, sizes)
