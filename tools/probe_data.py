"""The probe's training data: a seeded plan of micro-batches (length curriculum, tasks, sample seeds) and the
DataLoader whose workers build them with the RULER generators and the probe tokenizer (tools/train_probe.py)."""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch

from probe_tokenizer import build_probe_tokenizer
from sparsekv.tasks.ruler import generators
from sparsekv.tasks.ruler.generators import RulerSample, answer_text, make_sample

TRAIN_SEED_BASE = 10 ** 9  # training sample seeds are >= this; evaluation (task=ruler) uses seeds below it
QUESTION_WORDS = ["What", "Question"]  # the first word of every task's question (never in a haystack)
# Seconds of a 32K-token micro-batch at context L: MICRO_FIXED_S + MICRO_PER_LEN_S * L (docs/probe.md), the mean of
# two preflights of the recipe on one H100 (compiled, deterministic): 0.0375 s at 512 and 0.112 s at 32768
MICRO_PER_LEN_S = (0.112 - 0.0375) / (32768 - 512)
MICRO_FIXED_S = 0.0375 - 512 * MICRO_PER_LEN_S
# the committed checkpoint's mix; --task-weights overrides it. kv_adjacent is a training task, not the suite's
TASK_WEIGHTS = {"niah_single": 1.0, "niah_multikey": 2.0, "niah_multivalue": 1.5, "niah_multiquery": 1.5,
                "variable_tracking": 2.0, "common_words": 0.75, "kv_adjacent": 3.0}
KV_PAIRS = 8  # key-value facts of a kv_adjacent prompt, all asked


def parse_task_weights(text: str) -> dict[str, float]:
    """TASK_WEIGHTS with "task=weight,..." overriding the tasks it names; ValueError naming a bad entry."""
    weights = dict(TASK_WEIGHTS)
    for entry in filter(None, text.split(",")):
        task, _, value = entry.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if task not in weights or weight < 0:
            raise ValueError(f"--task-weights entry {entry!r}: write task=weight, weight >= 0, task one of "
                             f"{','.join(weights)}")
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


@dataclass(frozen=True)
class RecallSample(RulerSample):
    continuation: str = ""  # the training answer: every fact asked in turn
    unscored: tuple[int, ...] = ()  # token ids of the continuation that carry no loss (the asked keys)


def kv_adjacent_sample(tokenizer, length: int, seed: int, pairs: int = KV_PAIRS) -> RecallSample:
    """A training prompt for key matching in its plainest form (associative recall): `pairs` facts
    "amber 6073604." at random depths of the suite's haystack; the last line asks one key ("amber"), so its
    value follows the key in the question as in its fact, and the answer then asks every other key in a random
    order (" 6073604. mango 1134356. ..."): `pairs` key matches a sample, where niah_multikey has one. The keys
    in the answer carry no loss. Scored on the first value (the training script's check). Built with the
    generators' own haystack, layout and sizing."""
    rng = random.Random(f"kv_recall:{length}:{seed}:{pairs}")  # the committed run's sample seeds
    keys = rng.sample(generators.KEYS, pairs)
    values = generators._numbers(rng, pairs, generators.NIAH_DIGITS)
    inserts = [(rng.random(), f"{key} {value}.") for key, value in zip(keys, values)]
    order = rng.sample(range(pairs), pairs)
    layout = generators._haystack_layout(rng, generators.NIAH_INTRO, inserts, "", keys[order[0]],
                                         (values[order[0]],))
    _, prompt_ids = generators._fit(lambda n: generators._encode(tokenizer, layout(n)[0], False), length)
    continuation = " " + " ".join([f"{values[order[0]]}."] + [f"{keys[i]} {values[i]}." for i in order[1:]])
    return RecallSample(task="kv_adjacent", prompt_ids=prompt_ids, answers=(values[order[0]],),
                        max_new_tokens=generators.NIAH_DIGITS + 4, context_tokens=len(prompt_ids),
                        continuation=continuation,
                        unscored=tuple(tokenizer.convert_tokens_to_ids(list(generators.KEYS))))


def training_sample(task: str, tokenizer, length: int, seed: int) -> RulerSample:
    """A sample of the suite's task (make_sample) or of the training task kv_adjacent."""
    if task == "kv_adjacent":
        return kv_adjacent_sample(tokenizer, length, seed)
    return make_sample(task, tokenizer, length, seed)


def plan_seconds(plan: list[tuple[int, list]], micro_tokens: int = 32768) -> float:
    """Training time of a plan for the default model by the cost model of docs/probe.md: a micro-batch of 32K
    tokens at context L takes MICRO_FIXED_S + MICRO_PER_LEN_S * L (linear layers, overheads and data, then
    attention), measured by the preflight on a one-GPU H100 host with 14 data workers."""
    scale = micro_tokens / 32768
    return sum(scale * (MICRO_FIXED_S + MICRO_PER_LEN_S * length) for length, _ in plan)


def plan_summary(plan: list[tuple[int, list]], micro_tokens: int = 32768) -> str:
    samples = sum(len(s) for _, s in plan)
    long_share = sum(1 for length, _ in plan if length > 8192) / max(1, len(plan))
    return (f"{len(plan)} micro-batches, {samples:,} samples, {long_share:.0%} of micro-batches above 8K, "
            f"about {plan_seconds(plan, micro_tokens):.0f} s of training on one H100 (cost model)")


class MicroBatches(torch.utils.data.Dataset):
    """Item m: micro-batch m of the plan (samples (task, seed): training_sample) as input_ids [B, T]
    (right-padded) and its targets as flat positions into [B * T] with the token each must predict: the answer
    and EOS (weight 1; a RecallSample's asked keys 0), and with `tail_weight` the question and answer prefix, whose
    key and value words repeat the context's (they teach copying)."""

    def __init__(self, plan: list[tuple[int, list[tuple]]], tail_weight: float = 0.0):
        self.plan = plan
        self.tail_weight = tail_weight
        self.tokenizer = None

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, m: int) -> dict[str, torch.Tensor | int]:
        if self.tokenizer is None:
            self.tokenizer = build_probe_tokenizer()
        tok = self.tokenizer
        question_starts = set(tok.convert_tokens_to_ids(QUESTION_WORDS))
        length, samples = self.plan[m]
        rows, spans = [], []
        for task, seed in samples:
            sample = training_sample(task, tok, length, seed)
            prompt = sample.prompt_ids
            if isinstance(sample, RecallSample):
                text, unscored_ids = sample.continuation, set(sample.unscored)
            else:
                text, unscored_ids = answer_text(sample), set()
            answer = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            tail = next((i for i in range(len(prompt) - 1, 0, -1) if prompt[i] in question_starts), len(prompt))
            rows.append(prompt + answer)
            spans.append((tail, len(prompt), unscored_ids))
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        positions, labels, answer, unscored = [], [], [], []
        for b, (row, (tail, answer_start, skip)) in enumerate(zip(rows, spans)):
            input_ids[b, :len(row)] = torch.tensor(row)
            first = tail if self.tail_weight > 0 else answer_start
            for t in range(first, len(row)):  # position t - 1 predicts token t
                positions.append(b * width + t - 1)
                labels.append(row[t])
                unscored.append(t >= answer_start and row[t] in skip)
                answer.append(t >= answer_start and not unscored[-1])
        answer_t = torch.tensor(answer, dtype=torch.bool)
        weights = torch.where(answer_t, 1.0, self.tail_weight)
        weights = weights.masked_fill(torch.tensor(unscored, dtype=torch.bool), 0.0)
        return {"input_ids": input_ids, "positions": torch.tensor(positions), "labels": torch.tensor(labels),
                "weights": weights, "answer": answer_t, "length": length, "tokens": sum(len(r) for r in rows)}


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)


def make_loader(plan, workers: int, pin: bool, tail_weight: float):
    import multiprocessing

    extra = {}
    if workers:
        context = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        extra = dict(prefetch_factor=4, worker_init_fn=_worker_init, multiprocessing_context=context)
    dataset = MicroBatches(plan, tail_weight)
    return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False,
                                       num_workers=workers, pin_memory=pin, **extra)
