"""Triton kernels compiled in parallel, ahead of the warm-up that launches them.

A cold process compiles each Triton specialization the first time it is launched, one after another: 14 of them
for Qwen3-4B's prefill and decode, 7-10 s on an H200 (docs/decisions.md). Here, instead:

* :func:`record` runs a function with every Triton launch turned into Triton's own "warm-up" (nothing runs on the
  device) and every compile skipped (``knobs.runtime.jit_cache_hook`` answering True), and returns the
  specializations it asked for, each as Triton's JSON (``serialize_specialization_data``);
* :func:`compile_all` compiles them in forked worker processes, which write Triton's on-disk cache (the kernels and,
  where the Triton release builds one, their launchers) and touch no CUDA;
* the caller then runs the real warm-up, whose compiles are cache loads.

A manifest of a config's specializations is kept inside Triton's cache directory (so it goes when that cache is
cleared), and a process that finds it skips the record pass.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._dispatch import HAS_TRITON

log = logging.getLogger(__name__)

MANIFEST_DIR = "sparsekv-manifests"
WORKER_TIMEOUT_SECONDS = 300.0  # a compile that never ends leaves its kernel to the warm-up, not a hang


def supported() -> bool:
    """Triton with the compile hook (3.4 and later) on a system that forks (Linux)."""
    if not HAS_TRITON or not hasattr(os, "fork"):
        return False
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is not None and hasattr(runtime, "jit_cache_hook")


def cache_dir() -> Path:
    import triton

    return Path(triton.knobs.cache.dir)


def manifest_path(key: dict[str, Any]) -> Path:
    """Where the specializations of `key` (what decides them: the config's kernel-relevant sections, the GPU,
    the Triton and torch releases) are kept."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return cache_dir() / MANIFEST_DIR / f"{digest}.json"


def read_manifest(path: Path) -> list[str] | None:
    try:
        specs = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return specs if isinstance(specs, list) and all(isinstance(s, str) for s in specs) else None


def write_manifest(path: Path, specs: list[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(specs))
        tmp.replace(path)  # atomic: a concurrent reader sees the old manifest or the whole new one
    except OSError as exc:  # a read-only cache only costs the next process its record pass
        log.debug("could not write %s: %s", path, exc)


def record(fn: Callable[[], Any]) -> tuple[list[str], Exception | None]:
    """Run `fn` with no Triton kernel launched or compiled: (the specializations it asked for, in order; the
    exception `fn` raised, if any, with the specializations asked for until then).

    Every launch, cached or not, becomes Triton's warm-up call (compile-only), and every compile is skipped, so
    the device never runs a Triton kernel here and whatever reads their outputs reads unwritten memory: `fn` must
    leave nothing behind that a later request reads (the engine's warm-up requests free their blocks)."""
    import triton
    from triton.runtime.jit import JITFunction

    specs: list[str] = []

    def skip_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        if compile["specialization_data"] not in specs:
            specs.append(compile["specialization_data"])
        return True

    launch = JITFunction.run

    def run_without_launch(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    runtime = triton.knobs.runtime
    previous_hook = runtime.jit_cache_hook
    runtime.jit_cache_hook, JITFunction.run = skip_compile, run_without_launch
    error = None
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - handed to the caller, which cleans up after fn
        error = exc
    finally:
        runtime.jit_cache_hook, JITFunction.run = previous_hook, launch
    return specs, error


def _jit_function(full_name: str):
    """The JITFunction of the Python function `module.qualname` (Triton names a kernel by the function it wraps;
    an autotuner or other wrapper is looked through via .fn)."""
    from triton.runtime.jit import JITFunction

    module_name, _, qualname = full_name.rpartition(".")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    if isinstance(obj, JITFunction):
        return obj
    for value in vars(module).values():  # kernel = triton.jit(function) under another name
        while not isinstance(value, JITFunction) and hasattr(value, "fn"):
            value = value.fn
        if isinstance(value, JITFunction) and value.fn is obj:
            return value
    raise LookupError(f"no Triton kernel wraps {full_name}")


def compile_spec(spec: str, target) -> None:
    """Compile one specialization (Triton's JSON) for `target` into the on-disk cache, as JITFunction.preload
    would, but with no device: the target comes from the parent (or from the JSON, where Triton writes it)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    data = json.loads(spec)
    fn = _jit_function(data["name"])

    def as_tuple(value):
        return tuple(as_tuple(v) for v in value) if isinstance(value, list) else value

    def constant(value):
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(as_tuple(value["constexpr"]))
        return as_tuple(value)

    constexprs = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: as_tuple(v) for k, v in data["signature"].items()}
    if "target" in data:
        target = GPUTarget(**data["target"])
    backend = make_backend(target)
    options = backend.parse_options({k: as_tuple(v) for k, v in data["options"].items()})
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (attention_sm90.py): Gluon's front end, as at launch
        from triton.experimental.gluon._runtime import GluonASTSource as source
    kernel = triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    from triton.runtime.driver import driver

    launcher = getattr(driver.active, "launcher_cls", None)
    if launcher is not None:  # a Triton release that builds a C launcher per signature caches it here
        launcher(kernel.src, kernel.metadata)


def _compile_in_worker(args: tuple[str, Any]) -> tuple[str, str | None]:
    spec, target = args
    try:
        compile_spec(spec, target)
        return spec, None
    except Exception as exc:  # noqa: BLE001 - reported; the warm-up compiles that kernel itself
        return spec, f"{type(exc).__name__}: {exc}"


def _share_before_fork(specs: list[str], target) -> None:
    """Work every worker would repeat, done once here so that the forks inherit it: Triton's own hash of its
    sources, the backend's (ptxas --version) and each kernel's source hash, all cached on first use."""
    from triton.compiler import make_backend

    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # older releases keep it beside compile()
        from triton.compiler.compiler import triton_key
    steps = [triton_key, lambda: make_backend(target).hash()]
    steps += [lambda name=name: _jit_function(name).cache_key for name in {json.loads(s)["name"] for s in specs}]
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - a worker meets the same error and reports it for its kernel
            log.debug("preparing the compile workers: %s: %s", type(exc).__name__, exc)


def compile_all(specs: list[str], workers: int) -> dict[str, Any]:
    """Compile `specs` into Triton's cache on `workers` processes forked from this one (they inherit the kernels'
    modules and never touch CUDA). {"compiled", "failed": [(name, error)], "seconds", "workers"}."""
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    workers = max(1, min(workers, len(specs)))
    start = time.perf_counter()
    _share_before_fork(specs, target)
    failed: list[tuple[str, str]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12: fork() in a process with threads
        pool = multiprocessing.get_context("fork").Pool(workers)
    try:
        pending = pool.imap_unordered(_compile_in_worker, [(spec, target) for spec in specs])
        deadline = time.monotonic() + WORKER_TIMEOUT_SECONDS
        for _ in specs:
            spec, error = pending.next(timeout=max(0.0, deadline - time.monotonic()))
            if error is not None:
                failed.append((json.loads(spec)["name"], error))
    except multiprocessing.TimeoutError:
        failed.append(("(workers)", f"timed out after {WORKER_TIMEOUT_SECONDS:.0f} s"))
    finally:
        pool.terminate()
        pool.join()
    for name, error in failed:
        log.debug("compiling %s ahead failed (the warm-up compiles it): %s", name, error)
    return {"compiled": len(specs) - len(failed), "failed": failed, "seconds": time.perf_counter() - start,
            "workers": workers}


def count_cached() -> int:
    """Entries in Triton's cache directory: the warm-up's new ones are kernels it compiled itself."""
    try:
        return sum(1 for _ in os.scandir(cache_dir()))
    except OSError:
        return 0


def compile_ahead(key: dict[str, Any], warm_up: Callable[[], Any], workers: int | None = None) -> dict[str, Any]:
    """The kernels `warm_up` will launch, compiled in parallel now: recorded by running it once with nothing
    launched (skipped when this config's manifest is in the cache), then compiled on `workers` processes
    (default: one per CPU core). Returns the figures {"recorded", "record_error", "record_seconds", "compiled",
    "failed", "seconds", "workers"}; a record pass that raised keeps what it recorded and writes no manifest."""
    path = manifest_path(key)
    specs = read_manifest(path)
    figures: dict[str, Any] = {"recorded": specs is None, "record_error": None, "record_seconds": 0.0,
                               "compiled": 0, "failed": [], "seconds": 0.0, "workers": 0}
    if specs is not None:
        return figures  # compiled by an earlier process into this cache
    start = time.perf_counter()
    specs, figures["record_error"] = record(warm_up)
    figures["record_seconds"] = time.perf_counter() - start
    if specs:
        figures.update(compile_all(specs, workers or os.cpu_count() or 1))
    if figures["record_error"] is None:
        write_manifest(path, specs)
    return figures
