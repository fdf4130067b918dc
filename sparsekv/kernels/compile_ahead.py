"""Compile a run's Triton kernels on a thread pool before they first run.

A fresh process compiles every Triton kernel the first time it launches, one after another; on an H100 host the
decode kernels of one model take seconds that way. Triton's compiler spends most of its time outside the GIL
(MLIR passes, LLVM, ptxas), so kernels compile in parallel on threads. :func:`compile_only` makes every Triton
launch inside it a compile request instead: the launch binds its arguments (so the specialization is exactly the
one a real launch will ask for), submits the compile to a thread pool and returns without running anything
(Triton's ``warmup`` launch under its ``AsyncCompileMode``). Leaving the block waits for every compile and puts the
kernels in Triton's caches; the real launches that follow find them there.

Inside the block no Triton kernel runs, so what they would have written is garbage: the caller runs a throw-away
request there (the engine's warm-up does) and then the real one.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from ._dispatch import HAS_TRITON, INTERPRET

__all__ = ["compile_ahead_supported", "compile_only"]


def compile_ahead_supported() -> bool:
    """Whether this Triton compiles asynchronously (``triton.runtime._async_compile``) and kernels are compiled
    at all (not under the interpreter)."""
    if not HAS_TRITON or INTERPRET:
        return False
    try:
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
        from triton.runtime.jit import JITFunction  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def compile_only(workers: int | None = None) -> Iterator[None]:
    """Within the block, Triton launches compile on `workers` threads (default: the CPUs this process may use)
    and do not run; on exit every compile has finished (a failed one is left for its real launch to redo)."""
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    workers = workers or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    launch = JITFunction.run

    def compile_request(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool:
        with AsyncCompileMode(pool, ignore_errors=True):
            JITFunction.run = compile_request
            try:
                yield
            finally:
                JITFunction.run = launch
