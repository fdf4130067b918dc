"""task=generate: generate from `prompt`, print the text and the run's figures."""
from __future__ import annotations

from omegaconf import DictConfig

from sparsekv.llm import LLM, default_sampling_params
from sparsekv.progress import GenerationProgress
from sparsekv.tasks.common import write_record


def run(cfg: DictConfig) -> dict:
    params = default_sampling_params(cfg)
    llm = LLM.from_config(cfg)
    engine = llm.engine
    progress = GenerationProgress(engine, len(engine.tokenize(cfg.prompt)), params.max_tokens,
                                  enabled=bool(cfg.task.progress))
    try:
        out = llm.generate([cfg.prompt], params, progress=progress)[0]
    finally:
        progress.close()
    stats = engine.stats
    figures = {
        "prompt_tokens": len(out.prompt_token_ids),
        "generated_tokens": len(out.token_ids),
        "prefill_tok_s": stats.prefill_tok_s,
        "decode_tok_s": stats.decode_tok_s,
        "decode_ms_per_token": stats.decode_ms_per_step,
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
    print("peak memory: " + ", ".join(f"{k} {v:.3f}" for k, v in engine.peak_memory().items()))
    path = write_record(cfg, "generate", figures)
    print(f"record: {path}")
    return figures
