"""The probe's training data: a seeded plan of micro-batches (length curriculum, tasks, sample seeds) and the
DataLoader whose workers build them with the RULER generators and the probe tokenizer (tools/train_probe.py)."""
from __future__ import annotations

import argparse
import random

import torch

from probe_tokenizer import build_probe_tokenizer
from sparsekv.tasks.ruler.generators import answer_text, make_sample

TRAIN_SEED_BASE = 10 ** 9  # training sample seeds are >= this; evaluation (task=ruler) uses seeds below it
QUESTION_WORDS = ["What", "Question"]  # the first word of every task's question (never in a haystack)
TASK_WEIGHTS = {"niah_single": 1.0, "niah_multikey": 1.5, "niah_multivalue": 1.5, "niah_multiquery": 1.5,
                "variable_tracking": 2.0, "common_words": 0.75}


def length_buckets(min_len: int, max_len: int) -> list[int]:
    """Powers of two and their 1.5x midpoints between min_len and max_len, both ends included."""
    grid = {min_len, max_len}
    for exp in range(6, 17):
        grid.update(x for x in (2 ** exp, 3 * 2 ** (exp - 1)) if min_len < x < max_len)
    return sorted(grid)


def micro_plan(args: argparse.Namespace) -> list[tuple[int, list[tuple[str, int]]]]:
    """Per micro-batch: its context length and its (task, seed) samples, a pure function of the arguments."""
    buckets = length_buckets(args.min_len, args.max_len)
    tasks, weights = args.tasks, [TASK_WEIGHTS[t] for t in args.tasks]
    plan = []
    for step in range(args.steps):
        reach = args.min_len * (args.max_len / args.min_len) ** min(1.0, step / (args.ramp * args.steps))
        allowed = [b for b in buckets if b <= reach * 1.0001] or buckets[:1]
        for j in range(args.accum):
            rng = random.Random(f"probe:{args.seed}:{step}:{j}")
            frontier = allowed[-4:]  # the top two octaves reached
            length = rng.choice(allowed if rng.random() < 0.5 else frontier)
            count = max(1, args.micro_tokens // length)
            plan.append((length, [(rng.choices(tasks, weights)[0], TRAIN_SEED_BASE + rng.randrange(TRAIN_SEED_BASE))
                                  for _ in range(count)]))
    return plan


class MicroBatches(torch.utils.data.Dataset):
    """Item m: micro-batch m of the plan as input_ids [B, T] (right-padded) and its targets as flat positions
    into [B * T] with the token each must predict: the answer and EOS (weight 1), and with `tail_weight` the
    question and answer prefix, whose key and value words repeat the context's (they teach copying)."""

    def __init__(self, plan: list[tuple[int, list[tuple[str, int]]]], tail_weight: float = 0.0):
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
            sample = make_sample(task, tok, length, seed)
            prompt = sample.prompt_ids
            answer = tok.encode(answer_text(sample), add_special_tokens=False) + [tok.eos_token_id]
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


def make_loader(plan, workers: int, pin: bool, tail_weight: float):
    import multiprocessing

    extra = {}
    if workers:
        context = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        extra = dict(prefetch_factor=4, worker_init_fn=_worker_init, multiprocessing_context=context)
    return torch.utils.data.DataLoader(MicroBatches(plan, tail_weight), batch_size=None, shuffle=False, num_workers=workers,
                                       pin_memory=pin, **extra)
