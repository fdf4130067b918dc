"""A cold CUDA engine's Triton kernels compiled in parallel before its warm-up (sparsekv/kernels/compile_ahead.py).

The record pass runs the engine's greedy warm-up request with no Triton kernel launched, so the torch operations
between them read unwritten memory. That is safe for sparsekv's own model and policies (their index tensors come
from the host or from top-k / argmax, always in range) and nothing of it outlives the request: its blocks are freed,
the figures reset, and the graphs captured meanwhile (which hold no Triton kernel) are replaced by a fresh runner.
A plugin's model or policy may index with what a kernel wrote, so with one of those every kernel compiles at its
first launch, as before.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

import torch
from omegaconf import OmegaConf

from sparsekv.graphs.cuda_graph import attach_graph_runner
from sparsekv.kernels import compile_ahead
from sparsekv.kernels.backend import KernelChoice

log = logging.getLogger(__name__)

# what a run's kernels do not depend on
UNRELATED_KEYS = ("task", "sampling", "prompt", "seed", "output_dir", "compile_workers")
UNRELATED_MODEL_KEYS = ("name", "path", "load_format", "dummy_init_std")


def manifest_key(config, kernels: KernelChoice, gpu: dict[str, Any]) -> dict[str, Any]:
    """What decides the specializations a config's warm-up launches: its kernel-relevant config sections, the
    kernel choice, the GPU (`gpu`: name and capability), and the Triton and torch releases."""
    import triton

    sections = OmegaConf.to_container(config, resolve=True)
    for key in UNRELATED_KEYS:
        sections.pop(key, None)
    for key in UNRELATED_MODEL_KEYS:
        sections.get("model", {}).pop(key, None)
    return {"config": sections, "kernels": dataclasses.asdict(kernels), "gpu": gpu, "triton": triton.__version__,
            "torch": torch.__version__}


def built_in(engine) -> bool:
    """The model and both policies are sparsekv's own (see the module docstring)."""
    store = engine.kv_store
    parts = (engine.model, engine.policy, getattr(store, "prefill_policy", None), getattr(store, "decode_policy", None))
    return all(type(part).__module__.startswith("sparsekv.") for part in parts if part is not None)


def warm_up(engine, kernels: KernelChoice, graph_mode, graph_cfg) -> None:
    """engine.warm_up(), its Triton kernels first compiled ahead in parallel when that applies (see
    compile_kernels_ahead); startup["compiled_in_warm_up"]: the kernels the warm-up still compiled itself."""
    figures = compile_kernels_ahead(engine, kernels, graph_mode, graph_cfg)
    engine.warm_up()
    if figures is not None:
        engine.startup["compiled_in_warm_up"] = compile_ahead.count_cached() - figures["cache_entries"]


def compile_kernels_ahead(engine, kernels: KernelChoice, graph_mode, graph_cfg) -> dict[str, Any] | None:
    """Compile the kernels `engine.warm_up()` will launch on config.compile_workers processes, when this is a CUDA
    engine of Triton kernels built from sparsekv's own parts and the Triton release has the hook it needs. Adds
    startup["compile_ahead_seconds"] and returns the figures (None: not run)."""
    workers = engine.config.get("compile_workers")
    if (workers == 0 or engine.device.type != "cuda" or not kernels.triton or not compile_ahead.supported()
            or not built_in(engine) or engine.config.get("check_selections")):  # its checks read the selections
        return None
    start = time.perf_counter()
    gpu = {"name": torch.cuda.get_device_name(engine.device),
           "capability": list(torch.cuda.get_device_capability(engine.device))}
    with warnings.catch_warnings():  # a graph of Triton launches alone (a segment's norm) captures nothing here
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty", category=UserWarning)
        figures = compile_ahead.compile_ahead(manifest_key(engine.config, kernels, gpu), engine.warm_up_greedy,
                                              workers)
    if figures["recorded"]:
        if figures["record_error"] is not None:
            error = figures["record_error"]
            log.warning("compiling Triton kernels ahead stopped (%s: %s); the rest compile at first launch",
                        type(error).__name__, error)
            for seq in [*engine.scheduler.waiting, *engine.scheduler.running]:
                engine.abort(seq)
            engine.reset_figures()
        attach_graph_runner(engine, graph_mode, graph_cfg)  # the record pass's graphs launch no Triton kernel
        torch.cuda.synchronize(engine.device)
    engine.startup["compile_ahead_seconds"] = time.perf_counter() - start
    engine.startup["compiled_ahead"] = figures["compiled"]  # 0: this config's manifest was found
    figures["cache_entries"] = compile_ahead.count_cached()
    if figures["recorded"]:
        log.info("compiled %d Triton kernels ahead on %d processes in %.2f s (recorded in %.2f s)%s",
                 figures["compiled"], figures["workers"], figures["seconds"], figures["record_seconds"],
                 f"; {len(figures['failed'])} left to the warm-up" if figures["failed"] else "")
    return figures
