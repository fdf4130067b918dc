"""task=ruler: a RULER-style long-context suite through the configured engine (model, offload, policy, plugins).

    python -m sparsekv task=ruler model=hf model.path=/ckpt offload=cpu policy=quest "task.lengths=[4096,16384]"
    python -m sparsekv -m task=ruler model=hf model.path=/ckpt policy=full,quest per_policy.quest.token_budget=512,1024

For each task of task.tasks (sparsekv.tasks.ruler.generators.TASKS: needle retrieval with one or several keys,
values and queries, variable tracking, common-word counting) and each length of task.lengths, task.samples prompts
of that many tokens are generated greedily (ignore_eos=False, each sample's own max_new_tokens), task.batch_size
at a time, and scored (generators.score_output: the share of the expected answers found in the output). With
task.with_needles=false the facts asked about are left out: a sound pipeline then scores at chance. task.needles
(2-32) sets how many needles the multi-needle tasks hold and how many chains variable_tracking does (the suite's
own: 4 and 2): more distractors, a harder suite.

Per (task, length) cell: accuracy (mean score in [0, 1]), samples, prompt tokens, prefill seconds per sample and
tok/s, decode ms/token (median engine step, as task=bench), and the policy's density (sparsekv.tasks.ruler.density:
measured when the policy records it). Per length, the same over the tasks ("by_length"). Prints a table and writes
ruler.json (tasks.common.write_record); task=report turns a sweep of them into tables and accuracy-vs-density plots.
Every setting is checked before the weights load (sparsekv.tasks.ruler.settings).
"""
from __future__ import annotations

import copy
import random
import statistics
import time
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from sparsekv.tasks.common import enum_value, policy_warnings, print_warnings, run_identity
from sparsekv.tasks.ruler.density import cell_density
from sparsekv.tasks.ruler.settings import RulerSettings, ruler_settings
from sparsekv.tasks.ruler.table import print_table


EVAL_SEEDS = 10 ** 9  # sample seeds stay below this: tools/train_probe.py trains the probe on seeds at or above it


def sample_seed(seed: int, task: str, length: int, index: int) -> int:
    return random.Random(f"ruler-{seed}-{task}-{length}-{index}").randrange(EVAL_SEEDS)


def build_samples(cfg: DictConfig, settings: RulerSettings) -> dict[tuple[str, int], list]:
    """The prompts of every (task, length) cell; a prompt and its answer that do not fit max_model_len are an error
    here, before the weights load."""
    from sparsekv.tasks.ruler.generators import COUNTED_TASKS, make_sample

    task = cfg.task
    cells = {}
    for length in settings.lengths:
        for name in settings.tasks:
            needles = task.get("needles") if name in COUNTED_TASKS else None
            try:
                cells[(name, length)] = [
                    make_sample(name, settings.tokenizer, length, sample_seed(int(task.seed), name, length, i),
                                chat_template=settings.chat_template, with_needles=bool(task.with_needles),
                                needles=needles)
                    for i in range(int(task.samples))]
            except ValueError as exc:
                raise ValueError(f"task.lengths has {length}: {exc}") from exc
    needed = max(len(s.prompt_ids) + s.max_new_tokens for group in cells.values() for s in group)
    if needed > settings.max_model_len:
        worst = max((s for group in cells.values() for s in group), key=lambda s: len(s.prompt_ids) + s.max_new_tokens)
        limit = (f"scheduler.max_model_len={settings.max_model_len}" if cfg.scheduler.max_model_len else
                 f"the model's {settings.max_model_len} positions (max_position_embeddings)")
        raise ValueError(f"the {worst.task} prompt of length {worst.context_tokens} has {len(worst.prompt_ids)} tokens "
                         f"and may generate {worst.max_new_tokens}, more than {limit}: set scheduler.max_model_len to "
                         f"{needed} or drop the length from task.lengths")
    return cells


def engine_config(cfg: DictConfig, samples: dict[tuple[str, int], list]) -> DictConfig:
    """A copy of `cfg` whose scheduler runs task.batch_size sequences together and, unless scheduler.max_model_len
    is set, holds the longest prompt and its answer (the KV pool is sized to that, not to the model's maximum)."""
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        if cfg.scheduler.max_num_seqs < cfg.task.batch_size:
            cfg.scheduler.max_num_seqs = int(cfg.task.batch_size)
        if not cfg.scheduler.max_model_len:
            cfg.scheduler.max_model_len = max(len(s.prompt_ids) + s.max_new_tokens
                                               for group in samples.values() for s in group)
    return cfg


def warm_up(llm, sample) -> float:
    """The first cell's first prompt once, untimed (compilation out of that cell's figures); returns seconds."""
    from sparsekv.sampling_params import SamplingParams

    start = time.perf_counter()
    llm.generate([list(sample.prompt_ids)], SamplingParams(temperature=0.0, max_tokens=sample.max_new_tokens),
                 progress=False)
    return time.perf_counter() - start


def run_cell(llm, samples: list, batch_size: int, progress) -> tuple[list, float]:
    """Greedy outputs of `samples`, batch_size prompts at a time; returns (outputs, wall seconds)."""
    from sparsekv.sampling_params import SamplingParams

    outputs = []
    start = time.perf_counter()
    for first in range(0, len(samples), batch_size):
        batch = samples[first:first + batch_size]
        params = [SamplingParams(temperature=0.0, max_tokens=s.max_new_tokens, ignore_eos=False) for s in batch]
        outputs += llm.generate([list(s.prompt_ids) for s in batch], params, progress=False)
        progress.update(len(batch))
    return outputs, time.perf_counter() - start


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def cell_figures(name: str, length: int, samples: list, scores: list[float], outputs: list, stats,
                 wall_seconds: float, density: tuple[float | None, str | None]) -> dict[str, Any]:
    steps = stats.step_seconds
    return {
        "task": name, "length": length, "accuracy": _mean(scores), "samples": len(samples),
        "prompt_tokens": _mean(len(s.prompt_ids) for s in samples),
        "generated_tokens": sum(len(o.token_ids) for o in outputs),
        "prefill_seconds": stats.prefill_seconds / len(samples),  # per sample
        "prefill_tok_s": stats.prefill_tok_s or None,
        "decode_ms_per_token": 1e3 * statistics.median(steps) if steps else None,  # median engine step
        "decode_tok_s": stats.decode_tok_s or None,  # every sequence's tokens
        "density": density[0], "density_source": density[1],
        "wall_seconds": wall_seconds,
    }


def length_summary(cells: list[dict[str, Any]], length: int) -> dict[str, Any]:
    """A length's figures over its tasks: means (decode: the mean of the cells' medians)."""
    group = [c for c in cells if c["length"] == length]
    sources = {c["density_source"] for c in group} - {None}
    return {"task": "all", "length": length, "accuracy": _mean(c["accuracy"] for c in group),
            "samples": sum(c["samples"] for c in group),
            **{key: _mean(c[key] for c in group) for key in ("prompt_tokens", "prefill_seconds", "prefill_tok_s",
                                                              "decode_ms_per_token", "decode_tok_s", "density")},
            "density_source": sources.pop() if len(sources) == 1 else ("mixed" if sources else None)}


def run(cfg: DictConfig) -> dict:
    from sparsekv.llm import LLM
    from sparsekv.progress import bar
    from sparsekv.tasks.common import reserve_largest_batch, write_record
    from sparsekv.tasks.ruler.generators import score_output

    settings = ruler_settings(cfg)
    start = time.perf_counter()
    samples = build_samples(cfg, settings)
    build_seconds = time.perf_counter() - start
    cfg = engine_config(cfg, samples)
    task = cfg.task
    start = time.perf_counter()
    llm = LLM.from_config(cfg)
    engine, policy = llm.engine, llm.engine.policy
    load_seconds = time.perf_counter() - start
    block_size, num_layers = int(cfg.offload.block_size), settings.spec.num_hidden_layers
    warnings = policy_warnings(policy, range(num_layers), block_size, settings.lengths[0])
    print_warnings(warnings)
    batch_size = int(task.batch_size)
    batches = [[len(s.prompt_ids) + s.max_new_tokens + 1 for s in group[first:first + batch_size]]
               for group in samples.values() for first in range(0, len(group), batch_size)]
    reserve_seconds = reserve_largest_batch(engine, batches, block_size)
    warmup_seconds = warm_up(llm, next(iter(samples.values()))[0]) if task.warmup else None

    cells, records = [], []
    total = sum(len(group) for group in samples.values())
    with bar(total, "ruler", "sample", bool(task.progress)) as progress:
        for (name, length), group in samples.items():
            engine.reset_figures()
            outputs, wall = run_cell(llm, group, batch_size, progress)
            scores = [float(score_output(s, o.text)) for s, o in zip(group, outputs)]
            density = cell_density(policy, block_size, num_layers,
                                   [(len(s.prompt_ids), len(o.token_ids)) for s, o in zip(group, outputs)])
            cells.append(cell_figures(name, length, group, scores, outputs, engine.stats, wall, density))
            records += [{"task": name, "length": length, "index": i, "prompt_tokens": len(s.prompt_ids),
                         "answers": list(s.answers), "output": o.text, "score": score,
                         "finish_reason": o.finish_reason}
                        for i, (s, o, score) in enumerate(zip(group, outputs, scores))]
    by_length = [length_summary(cells, length) for length in settings.lengths]

    policy_cfg = OmegaConf.to_container(cfg.policy, resolve=True, enum_to_str=True)
    figures: dict[str, Any] = {
        **run_identity(cfg, engine, task.label),
        "policy_args": {k: v for k, v in policy_cfg.items() if k != "name"},
        "block_size": block_size,
        "num_gpu_blocks": cfg.offload.get("num_gpu_blocks") if enum_value(cfg.offload.mode) == "cpu" else None,
        "batch_size": int(task.batch_size),
        "seed": int(task.seed),
        "tasks": list(settings.tasks),
        "lengths": list(settings.lengths),
        "samples": int(task.samples),
        "chat_template": settings.chat_template,
        "with_needles": bool(task.with_needles),
        "needles": task.get("needles"),
        "accuracy": _mean(c["accuracy"] for c in cells),
        "density": _mean(c["density"] for c in cells),
        "accuracy_by_length": {str(s["length"]): s["accuracy"] for s in by_length},
        "accuracy_by_task": {name: _mean(c["accuracy"] for c in cells if c["task"] == name) for name in settings.tasks},
        "cells": cells,
        "by_length": by_length,
        "outputs": records,
        "warnings": warnings,
        "build_seconds": build_seconds,
        "load_seconds": load_seconds,
        "host_pool_reserve_seconds": reserve_seconds,
        "warmup_seconds": warmup_seconds,
        **engine.peak_memory(),
    }
    print_table(figures)
    path = write_record(cfg, "ruler", figures, engine.spec)
    print(f"record: {path}")
    return figures
