"""The probe's training data: a seeded plan of micro-batches (length curriculum, tasks, sample seeds) and the
DataLoader whose workers build them with the RULER generators and the probe tokenizer (tools/train_probe.py)."""
from __future__ import annotations

import argparse
import random

import torch

from probe_tokenizer import build_probe_tokenizer
from sparsekv.tasks.ruler.generators import answer_text, make_sample

RESTATED_TASKS = ("niah_single", "niah_multikey")  # one asked key: the answer may restate it

TRAIN_SEED_BASE = 10 ** 9  # training sample seeds are >= this; evaluation (task=ruler) uses seeds below it
QUESTION_WORDS = ["What", "Question"]  # the first word of every task's question (never in a haystack)
# Seconds of a 32K-token micro-batch at context L: MICRO_FIXED_S + MICRO_PER_LEN_S * L (docs/probe.md), the
# preflight's 0.046 s at 1024 and 0.078 s at 32768 on an H200 host with 14 data workers
MICRO_PER_LEN_S = (0.078 - 0.046) / (32768 - 1024)
MICRO_FIXED_S = 0.046 - 1024 * MICRO_PER_LEN_S
# the committed checkpoint's mix; --task-weights overrides it
TASK_WEIGHTS = {"niah_single": 1.0, "niah_multikey": 1.5, "niah_multivalue": 1.5, "niah_multiquery": 1.5,
                "variable_tracking": 2.0, "common_words": 0.75}


def parse_task_weights(text: str) -> dict[str, float]:
    """TASK_WEIGHTS with "task=weight,..." overriding the tasks it names; ValueError naming a bad entry."""
    weights = dict(TASK_WEIGHTS)
    for entry in filter(None, text.split(",")):
        task, _, value = entry.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if task not in TASK_WEIGHTS or weight < 0:
            raise ValueError(f"--task-weights entry {entry!r}: write task=weight, weight >= 0, task one of "
                             f"{','.join(TASK_WEIGHTS)}")
        weights[task] = weight
    return weights


def length_buckets(min_len: int, max_len: int) -> list[int]:
    """Powers of two and their 1.5x midpoints between min_len and max_len, both ends included."""
    grid = {min_len, max_len}
    for exp in range(6, 17):
        grid.update(x for x in (2 ** exp, 3 * 2 ** (exp - 1)) if min_len < x < max_len)
    return sorted(grid)


def longest_length(step: int, args: argparse.Namespace) -> float:
    """The longest context the curriculum allows at `step`: --short-len for the first --short-frac of the steps,
    then doubling up to --max-len over the next --ramp of the steps, then --max-len."""
    start = args.short_frac * args.steps
    if step < start:
        return float(args.short_len)
    progress = (step - start) / max(1e-9, args.ramp * args.steps)
    return args.short_len * (args.max_len / args.short_len) ** min(1.0, progress)


def micro_plan(args: argparse.Namespace) -> list[tuple[int, list[tuple]]]:
    """Per micro-batch: its context length and its (task, seed) samples, a pure function of the arguments. A
    micro-batch's length is drawn from the top two octaves reached with probability --frontier-share, else
    uniformly from every length reached."""
    buckets = length_buckets(args.min_len, args.max_len)
    tasks, weights = args.tasks, [args.task_weights[t] for t in args.tasks]
    plan = []
    for step in range(args.steps):
        reach = longest_length(step, args)
        allowed = [b for b in buckets if b <= reach * 1.0001] or buckets[:1]
        for j in range(args.accum):
            rng = random.Random(f"probe:{args.seed}:{step}:{j}")
            frontier = allowed[-4:]  # the top two octaves reached
            # drawn as the committed checkpoint's plan drew it (any length below 0.5, the frontier above)
            length = rng.choice(allowed if rng.random() < 1 - args.frontier_share else frontier)
            count = max(1, args.micro_tokens // length)
            plan.append((length, [(rng.choices(tasks, weights)[0], TRAIN_SEED_BASE + rng.randrange(TRAIN_SEED_BASE))
                                  for _ in range(count)]))
    return plan


def fitted_sample(task: str, tokenizer, length: int, seed: int, facts: int | None = None):
    """make_sample with `facts` needles or chains, halved until the prompt fits `length`; the suite's own counts
    when `facts` is None or no count from 4 up fits."""
    while facts is not None:
        try:
            return make_sample(task, tokenizer, length, seed, needles=facts)
        except ValueError:
            if facts <= 4:
                break
            facts //= 2
    return make_sample(task, tokenizer, length, seed)


def plan_seconds(plan: list[tuple[int, list]], micro_tokens: int = 32768) -> float:
    """Training time of a plan for the default model by the cost model of docs/probe.md: a micro-batch of 32K
    tokens at context L takes MICRO_FIXED_S + MICRO_PER_LEN_S * L (linear layers, overheads and data, then
    attention), measured by the preflight on an H200 host with 14 data workers."""
    scale = micro_tokens / 32768
    return sum(scale * (MICRO_FIXED_S + MICRO_PER_LEN_S * length) for length, _ in plan)


def plan_summary(plan: list[tuple[int, list]], micro_tokens: int = 32768) -> str:
    samples = sum(len(s) for _, s in plan)
    long_share = sum(1 for length, _ in plan if length > 8192) / max(1, len(plan))
    return (f"{len(plan)} micro-batches, {samples:,} samples, {long_share:.0%} of micro-batches above 8K, "
            f"about {plan_seconds(plan, micro_tokens):.0f} s of training on one H200 (cost model)")


def restated_answer(sample, tokenizer) -> str:
    """A one-key answer that first restates the asked key as its needle states it: " amber is: 6073604." (the
    needle reads "... for amber is: 6073604."), so the value follows the same three tokens in the answer as in
    the asked needle alone. The key is the word after the last "for" of the prompt (the answer prefix's)."""
    tokens = tokenizer.convert_ids_to_tokens(sample.prompt_ids)
    key = tokens[len(tokens) - 1 - tokens[::-1].index("for") + 1]
    return f" {key} is: " + ", ".join(sample.answers) + "."


class MicroBatches(torch.utils.data.Dataset):
    """Item m: micro-batch m of the plan (samples (task, seed), or (task, seed, facts) for a sample with that many
    needles or chains: fitted_sample) as input_ids [B, T] (right-padded) and its targets as flat positions
    into [B * T] with the token each must predict: the answer and EOS (weight 1), and with `tail_weight` the
    question and answer prefix, whose key and value words repeat the context's (they teach copying)."""

    def __init__(self, plan: list[tuple[int, list[tuple]]], tail_weight: float = 0.0,
                 spell_names: bool = False, restate_key: bool = False):
        self.plan = plan
        self.tail_weight = tail_weight
        self.spell_names = spell_names
        self.restate_key = restate_key
        self.tokenizer = None

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, m: int) -> dict[str, torch.Tensor | int]:
        if self.tokenizer is None:
            self.tokenizer = build_probe_tokenizer(spell_names=self.spell_names)
        tok = self.tokenizer
        question_starts = set(tok.convert_tokens_to_ids(QUESTION_WORDS))
        length, samples = self.plan[m]
        rows, spans = [], []
        for task, seed, *facts in samples:
            sample = fitted_sample(task, tok, length, seed, *facts)
            prompt = sample.prompt_ids
            restate = self.restate_key and task in RESTATED_TASKS
            text = restated_answer(sample, tok) if restate else answer_text(sample)
            answer = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            tail = next((i for i in range(len(prompt) - 1, 0, -1) if prompt[i] in question_starts), len(prompt))
            rows.append(prompt + answer)
            spans.append((tail, len(prompt)))
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        positions, labels, answer = [], [], []
        for b, (row, (tail, answer_start)) in enumerate(zip(rows, spans)):
            input_ids[b, :len(row)] = torch.tensor(row)
            first = tail if self.tail_weight > 0 else answer_start
            for t in range(first, len(row)):  # position t - 1 predicts token t
                positions.append(b * width + t - 1)
                labels.append(row[t])
                answer.append(t >= answer_start)
        answer_t = torch.tensor(answer, dtype=torch.bool)
        weights = torch.where(answer_t, 1.0, self.tail_weight)
        return {"input_ids": input_ids, "positions": torch.tensor(positions), "labels": torch.tensor(labels),
                "weights": weights, "answer": answer_t, "length": length, "tokens": sum(len(r) for r in rows)}


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)


def make_loader(plan, workers: int, pin: bool, tail_weight: float, spell_names: bool = False,
                restate_key: bool = False):
    import multiprocessing

    extra = {}
    if workers:
        context = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        extra = dict(prefetch_factor=4, worker_init_fn=_worker_init, multiprocessing_context=context)
    dataset = MicroBatches(plan, tail_weight, spell_names, restate_key)
    return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False,
                                       num_workers=workers, pin_memory=pin, **extra)
