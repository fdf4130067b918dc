"""task=needle: RULER-style needle in a haystack with the configured engine (model, offload, policy, ...).

    python -m sparsekv task=needle model=hf model.path=/ckpt offload=cpu policy=quest \
        task.contexts=[8192,32768] task.depths=[0,0.5,1] task.num_samples=4

Each prompt is a haystack of repeated filler sentences with one needle sentence, "One of the special magic
numbers for {key} is: {value}.", inserted at a depth fraction of the haystack, then the question. The haystack
is filled until the tokenized prompt reaches the context length (in the model's tokens). Generation is greedy
(task.max_tokens tokens); a sample is correct when the 7-digit value appears in the output (exact match of
its digits). Prints accuracy per (context, depth) and writes needle.json (tasks.common.write_record).

Works with any checkpoint that has a tokenizer and with the built-in tiny model (byte tokenizer; its random
weights make the accuracy meaningless, but the run completes). A context shorter than the needle and the
question alone gives the shortest prompt possible (no filler; reported as prompt_tokens).
"""
from __future__ import annotations

import copy
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import DictConfig, open_dict

from sparsekv.tasks.common import policy_warnings, print_warnings, reserve_largest_batch, run_identity

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("What is the special magic number for {key} mentioned in the provided text? "
            "The special magic number for {key} mentioned in the provided text is")
KEYS = ["apple", "river", "window", "garden", "silver", "mountain", "candle", "forest", "ocean", "pencil", "violin",
        "harbor", "meadow", "lantern", "castle", "falcon", "orchid", "thunder", "glacier", "compass", "marble",
        "saddle", "beacon", "cobalt", "ember", "quartz", "willow", "zephyr", "canyon", "tulip", "anchor", "crystal"]


@dataclass
class Haystack:
    prompt: str
    token_ids: list[int]
    key: str
    value: str
    depth: float  # requested, in [0, 1]
    needle_start: int  # token index of the needle sentence's first token
    needle_end: int  # one past its last token
    context_start: int  # first token of the haystack (after a BOS, if the tokenizer adds one)
    context_end: int  # one past the haystack's last token (the question follows)
    filler_sentences: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def needle_depth(self) -> float:
        """Where the needle starts, as a fraction of the haystack's tokens (the needle's own excluded)."""
        span = (self.context_end - self.context_start) - (self.needle_end - self.needle_start)
        return (self.needle_start - self.context_start) / span if span > 0 else 0.0


def filler_sentences(filler: str = FILLER) -> list[str]:
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", filler.strip()) if s.strip()]
    if not sentences:
        raise ValueError("the filler text has no sentences")
    return sentences


def _compose(sentences: list[str], count: int, depth: float, needle: str, question: str) -> tuple[str, int, int, int]:
    """(prompt, needle char start, needle char end, haystack char end) with `count` filler sentences."""
    hay = [sentences[i % len(sentences)] for i in range(count)]
    ends = [0]  # characters before sentence i (and its separating space): the needle goes where depth falls
    for sentence in hay:
        ends.append(ends[-1] + len(sentence) + 1)
    target = depth * max(0, ends[-1] - 1)
    index = min(range(count + 1), key=lambda i: (abs(ends[i] - target), i))
    before, after = " ".join(hay[:index]), " ".join(hay[index:])
    text = (before + " " if before else "")
    start = len(text)
    text += needle
    end = len(text)
    text += (" " + after if after else "")
    context_end = len(text)
    return text + "\n" + question, start, end, context_end


def build_haystack(encode: Callable[[str], list[int]], context_tokens: int, depth: float, key: str, value: str,
                   filler: str = FILLER) -> Haystack:
    """The longest prompt of whole filler sentences whose tokenized length is at most `context_tokens`, with the
    needle at `depth` (0 = first sentence, 1 = last before the question)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} is outside [0, 1]")
    if context_tokens < 1:
        raise ValueError(f"needle context {context_tokens} must be a positive number of tokens")
    sentences = filler_sentences(filler)
    needle, question = NEEDLE.format(key=key, value=value), QUESTION.format(key=key)
    length = (lambda n: len(encode(_compose(sentences, n, depth, needle, question)[0])))
    base = length(0)
    count = 0
    if base < context_tokens:
        probe = 64
        per = max(1e-3, (length(probe) - base) / probe)  # tokens per filler sentence
        guess = max(0, int((context_tokens - base) / per))
        lo, hi = 0, max(1, 2 * guess + 8)  # length(lo) <= target; grow hi until it overshoots
        while length(hi) <= context_tokens:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:  # length(lo) <= target < length(hi)
            mid = (lo + hi) // 2
            if length(mid) <= context_tokens:
                lo = mid
            else:
                hi = mid
        count = lo
    prompt, start, end, context_end = _compose(sentences, count, depth, needle, question)
    token_ids = encode(prompt)
    def tokens(text: str) -> int:
        """Tokens of the prompt before character len(text) (a trailing space that the tokenizer merges into the
        next word's token is left to that token)."""
        ids = encode(text)
        if ids == token_ids[:len(ids)]:
            return len(ids)
        return len(encode(text.rstrip()))

    return Haystack(prompt, token_ids, key, value, depth, tokens(prompt[:start]), tokens(prompt[:end]), tokens(""),
                    tokens(prompt[:context_end]), count)


def sample_key_value(seed: int, context: int, depth: float, sample: int) -> tuple[str, str]:
    rng = random.Random(f"needle-{seed}-{context}-{depth!r}-{sample}")
    return rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))


def score(output: str | None, value: str) -> bool:
    """Exact match: the value's digits appear in the output (spaces between digits tolerated)."""
    if not output:
        return False
    return value in output or value in re.sub(r"\D", "", output)


def check_needle_config(nd) -> None:
    if not nd.contexts:
        raise ValueError("task.contexts is empty: give at least one prompt length in tokens")
    for context in nd.contexts:
        if int(context) < 1:
            raise ValueError(f"task.contexts has {context}: prompt lengths must be positive token counts")
    if not nd.depths:
        raise ValueError("task.depths is empty: give at least one depth in [0, 1]")
    for depth in nd.depths:
        if not 0.0 <= float(depth) <= 1.0:
            raise ValueError(f"task.depths has {depth}: depths are fractions in [0, 1]")
    for key in ("num_samples", "max_tokens", "batch_size"):
        if int(nd[key]) < 1:
            raise ValueError(f"task.{key}={nd[key]} must be at least 1")


def run(cfg: DictConfig) -> dict:
    from sparsekv.factory import resolve_device
    from sparsekv.llm import LLM
    from sparsekv.models.loader import resolve_spec
    from sparsekv.progress import bar
    from sparsekv.sampling_params import SamplingParams
    from sparsekv.tasks.common import write_record
    from sparsekv.tokenizer import load_tokenizer

    nd = cfg.task
    check_needle_config(nd)
    resolve_device(cfg)  # a bad device fails before the haystacks are built
    spec = resolve_spec(cfg.model)
    tokenizer = load_tokenizer(cfg.model.path, spec.vocab_size)
    if tokenizer is None:
        raise ValueError(f"task=needle needs a tokenizer: model {cfg.model.name} has none (give a checkpoint "
                         "directory with tokenizer files as model.path)")
    start = time.perf_counter()
    samples: list[dict[str, Any]] = []
    for context in nd.contexts:
        for depth in nd.depths:
            for i in range(nd.num_samples):
                key, value = sample_key_value(nd.seed, int(context), float(depth), i)
                hay = build_haystack(tokenizer.encode, int(context), float(depth), key, value)
                samples.append({"context": int(context), "depth": float(depth), "sample": i, "key": key,
                                "value": value, "prompt_tokens": hay.num_tokens, "needle_token": hay.needle_start,
                                "needle_depth": hay.needle_depth, "_ids": hay.token_ids})
    build_seconds = time.perf_counter() - start
    longest = max(s["prompt_tokens"] for s in samples)
    short = sorted({s["context"] for s in samples if s["prompt_tokens"] > s["context"]})
    if short:
        print(f"note: contexts {short} are shorter than the needle and the question alone; those prompts have no "
              "filler and are longer than asked (see prompt_tokens)")

    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        needed = longest + nd.max_tokens + 1
        if (cfg.scheduler.max_model_len or spec.max_position_embeddings) < needed:
            cfg.scheduler.max_model_len = needed
    llm = LLM.from_config(cfg)
    engine = llm.engine
    warnings = policy_warnings(engine.policy, range(spec.num_hidden_layers), int(cfg.offload.block_size),
                               min(int(c) for c in nd.contexts))
    print_warnings(warnings)
    params = SamplingParams(temperature=0.0, max_tokens=int(nd.max_tokens))
    batches = [[s["prompt_tokens"] + int(nd.max_tokens) + 1 for s in samples[first:first + nd.batch_size]]
               for first in range(0, len(samples), nd.batch_size)]
    reserve_seconds = reserve_largest_batch(engine, batches, int(cfg.offload.block_size))
    start = time.perf_counter()
    with bar(len(samples), "needle", "sample", bool(nd.progress)) as items:
        for first in range(0, len(samples), nd.batch_size):
            batch = samples[first:first + nd.batch_size]
            outputs = llm.generate([s["_ids"] for s in batch], params, progress=False)  # one bar: samples
            for sample, out in zip(batch, outputs):
                sample["output"] = out.text
                sample["correct"] = score(out.text, sample["value"])
            items.update(len(batch))
    generate_seconds = time.perf_counter() - start
    for sample in samples:
        del sample["_ids"]

    contexts = list(dict.fromkeys(int(c) for c in nd.contexts))
    depths = list(dict.fromkeys(float(d) for d in nd.depths))
    accuracy = (lambda group: sum(s["correct"] for s in group) / len(group) if group else None)
    cells = [{"context": c, "depth": d, "accuracy": accuracy([s for s in samples if s["context"] == c
                                                              and s["depth"] == d]),
              "samples": sum(1 for s in samples if s["context"] == c and s["depth"] == d),
              "prompt_tokens": max(s["prompt_tokens"] for s in samples if s["context"] == c and s["depth"] == d)}
             for c in contexts for d in depths]
    stats = engine.stats
    figures: dict[str, Any] = {
        **run_identity(cfg, engine, nd.label),
        "block_size": cfg.offload.block_size,
        "context": contexts[0] if len(contexts) == 1 else None,
        "contexts": contexts,
        "depths": depths,
        "num_samples": int(nd.num_samples),
        "accuracy": accuracy(samples),
        "accuracy_by_context": {str(c): accuracy([s for s in samples if s["context"] == c]) for c in contexts},
        "accuracy_by_depth": {f"{d:g}": accuracy([s for s in samples if s["depth"] == d]) for d in depths},
        "cells": cells,
        "samples": samples,
        "warnings": warnings,
        "haystack_seconds": build_seconds,
        "host_pool_reserve_seconds": reserve_seconds,
        "generate_seconds": generate_seconds,
        "prefill_tok_s": stats.prefill_tok_s,
        "decode_tok_s": stats.decode_tok_s,
        **engine.peak_memory(),
    }
    print_table(figures)
    path = write_record(cfg, "needle", figures, engine.spec)
    print(f"record: {path}")
    return figures


def print_table(f: dict) -> None:
    print(f"needle {f['name']}: model={f['model']} offload={f['offload']} policy={f['policy']} on {f['device']}, "
          f"{f['dtype']}, {f['num_samples']} samples per cell")
    depths = f["depths"]
    header = ["context \\ depth", *[f"{d:g}" for d in depths], "all"]
    lines = [header]
    for c in f["contexts"]:
        row = [str(c)]
        for d in depths:
            cell = next(x for x in f["cells"] if x["context"] == c and x["depth"] == d)
            row.append(f"{100 * cell['accuracy']:.0f}%")
        row.append(f"{100 * f['accuracy_by_context'][str(c)]:.0f}%")
        lines.append(row)
    lines.append(["all", *[f"{100 * f['accuracy_by_depth'][f'{d:g}']:.0f}%" for d in depths],
                  f"{100 * f['accuracy']:.0f}%"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(line, widths)))
