"""The end-of-run check of tools/train_probe.py: greedy answers of the probe on held-out seeds, scored per task and
length. The proof is task=ruler (docs/probe.md); this only shows, as training ends, what the run learned."""
from __future__ import annotations

import argparse
import time
import warnings

import torch

from probe_data import training_sample
from sparsekv.tasks.ruler.generators import score_output

EVAL_LENGTHS = (2048, 8192, 32768)


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int, device: torch.device) -> list[int]:
    out = model.model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(model.lm_head(out.last_hidden_state[:, -1]).argmax(-1))
        if token == eos:
            break
        generated.append(token)
        with warnings.catch_warnings():  # past_key_values: the name every transformers 5 release accepts
            warnings.simplefilter("ignore", FutureWarning)
            out = model.model(input_ids=torch.tensor([[token]], device=device),
                              past_key_values=out.past_key_values, use_cache=True)
    return generated


def evaluate(args: argparse.Namespace, model, tokenizer, device: torch.device, hard_stop: float) -> dict:
    """Mean score per task and length on held-out seeds 0.. (greedy, the bfloat16 weights as saved)."""
    model.eval()
    lengths = sorted({min(n, args.max_len) for n in EVAL_LENGTHS})
    results: dict[str, dict[int, float]] = {}
    for task in args.tasks:
        for length in lengths:
            scores = []
            for seed in range(args.eval_samples):
                if time.time() > hard_stop:
                    print("evaluation cut short by --time-limit-min", flush=True)
                    return results
                sample = training_sample(task, tokenizer, length, seed)
                output = greedy(model, sample.prompt_ids, sample.max_new_tokens, tokenizer.eos_token_id, device)
                scores.append(score_output(sample, tokenizer.decode(output, skip_special_tokens=True)))
            results.setdefault(task, {})[length] = sum(scores) / len(scores)
    print("held-out accuracy (mean score, greedy) by context length:", flush=True)
    print(f"  {'task':<18}" + "".join(f"{n:>8}" for n in lengths))
    for task, row in results.items():
        print(f"  {task:<18}" + "".join(f"{row.get(n, float('nan')):8.2f}" for n in lengths), flush=True)
    return results
