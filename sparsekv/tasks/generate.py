"""task=generate: generate from `prompt`, print the text and the run's figures."""
from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig

from sparsekv.llm import LLM, default_sampling_params
from sparsekv.progress import GenerationProgress
from sparsekv.tasks.common import write_record


def run(cfg: DictConfig) -> dict:
    params = default_sampling_params(cfg)
    before_build = seconds_since_process_start()
    build_start = time.perf_counter()
    llm = LLM.from_config(cfg)
    build_seconds = time.perf_counter() - build_start
    engine = llm.engine
    progress = GenerationProgress(engine, len(engine.tokenize(cfg.prompt)), params.max_tokens,
                                  enabled=bool(cfg.task.progress))
    try:
        out = llm.generate([cfg.prompt], params, progress=progress)[0]
    finally:
        progress.close()
    stats = engine.stats
    phases = startup_figures(engine, before_build, build_seconds)
    figures = {
        "prompt_tokens": len(out.prompt_token_ids),
        "generated_tokens": len(out.token_ids),
        "prefill_tok_s": stats.prefill_tok_s,
        "decode_tok_s": stats.decode_tok_s,
        "decode_ms_per_token": stats.decode_ms_per_step,
        **phases,
        **engine.peak_memory(),
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
    }
    print(f"model: {cfg.model.name} ({engine.spec.architecture}) on {engine.device}, {engine.dtype}")
    print(f"prompt: {cfg.prompt!r}")
    print(f"output: {out.text if out.text is not None else out.token_ids!r}")
    print(f"prompt tokens {figures['prompt_tokens']}, generated {figures['generated_tokens']} "
          f"({out.finish_reason}); prefill {stats.prefill_tok_s:.1f} tok/s, decode {stats.decode_tok_s:.1f} tok/s "
          f"({stats.decode_ms_per_step:.2f} ms/token)")
    print(summary_line(phases))
    print("peak memory: " + ", ".join(f"{k} {v:.3f}" for k, v in engine.peak_memory().items()))
    path = write_record(cfg, "generate", figures, engine.spec)
    print(f"record: {path}")
    return figures


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc), None where unknown."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # fields 3.. after the command name
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time after boot, in clock ticks
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return None


def startup_figures(engine, before_build: float | None, build_seconds: float) -> dict[str, float | None]:
    """start-up (interpreter, imports and config before the engine build, then the build less its warm-up),
    compile (kernels in the warm-up, every graph capture) and steady state (the request's own figures)."""
    summary = engine.summary()
    warmup = engine.startup.get("warmup_seconds", 0.0)
    build = build_seconds - warmup
    return {
        "startup_seconds": (before_build or 0.0) + build,
        "import_config_seconds": before_build,
        "build_seconds": build,
        **summary,
    }


def summary_line(phases: dict) -> str:
    """e.g. start-up 2.1 s (import and config 1.2 s, weights 0.4 s, kv 0.1 s), compile 3.2 s (kernels 2.0 s, graphs
    1.2 s); steady state: prefill 2300.0 tok/s, decode 3.40 ms/token"""
    before = phases["import_config_seconds"]
    parts = ([f"import and config {before:.1f} s"] if before is not None else []) + [
        f"weights {phases['weights_seconds']:.1f} s", f"kv {phases['kv_seconds']:.1f} s"]
    return (f"start-up {phases['startup_seconds']:.1f} s ({', '.join(parts)}), "
            f"compile {phases['compile_seconds']:.1f} s "
            f"(kernels {phases['kernel_compile_seconds']:.1f} s, graphs {phases['graph_capture_seconds']:.1f} s); "
            f"steady state: prefill {phases['prefill_tok_s']:.1f} tok/s, decode {phases['decode_ms_per_token']:.2f} "
            "ms/token")
