"""Small-scale CPU trials of the probe's recipe on the one-key retrieval tasks (docs/probe.md, "Recipe trials on CPU").

    python3 tools/probe_cpu_trial.py --length 224 --steps 400 --mix niah_single=1,niah_multikey=1.5 --restate-key

One micro-batch of --batch samples a step at one context length, the probe's own model, loss and greedy decoding
(tools/train_probe.py, tools/probe_data.py), one thread. At the end: held-out seeds 0.. at each --eval-lens,
greedy and scored by score_output, and for niah_multikey which needle's value the output holds (the asked one,
a distractor's, or none), so a model that copies a random needle (about 0.25) is told from one that matches keys.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS.parent), str(TOOLS)]

import torch  # noqa: E402

import probe_data  # noqa: E402
from probe_tokenizer import build_probe_tokenizer  # noqa: E402
from sparsekv.tasks.ruler import generators  # noqa: E402
from train_probe import build_model, greedy, learning_rate, micro_step  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=224, help="training context length, in tokens")
    p.add_argument("--long-length", type=int, default=0, help="after --long-from of the steps, train at this length")
    p.add_argument("--long-from", type=float, default=1.0, help="fraction of the steps spent at --length")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32, help="samples per step")
    p.add_argument("--mix", default="niah_single=1,niah_multikey=1.5", help="task=weight,... (others 0)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--qk-norm-lr-mult", type=float, default=5.0)
    p.add_argument("--tail-weight", type=float, default=0.25)
    p.add_argument("--restate-key", action="store_true", help="one-key answers restate the key (probe_data)")
    p.add_argument("--few-needles-until", type=float, default=0.0,
                   help="fraction of the steps whose samples have 2 needles (multikey: 1 distractor), not 4")
    p.add_argument("--needles", type=int, default=0,
                   help="needles (variable_tracking: chains) of every training sample of generators.COUNTED_TASKS, "
                        "halved until it fits (0: the suite's counts)")
    p.add_argument("--spell-names", action="store_true")
    p.add_argument("--init", default="", help="start from this checkpoint (e.g. sparsekv/checkpoints/probe)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-lens", default="224,448")
    p.add_argument("--eval-tasks", default="niah_single,niah_multikey")
    p.add_argument("--eval-n", type=int, default=40)
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    weights = {t: 0.0 for t in probe_data.TASK_WEIGHTS}
    weights.update({t: w for t, w in probe_data.parse_task_weights(args.mix).items() if f"{t}=" in args.mix})
    args.tasks = [t for t, w in weights.items() if w > 0]
    args.weights = [weights[t] for t in args.tasks]
    args.warmup = max(1, args.steps // 10)
    return args


def step_plan(args: argparse.Namespace, step: int) -> tuple[int, list[tuple]]:
    import random

    rng = random.Random(f"trial:{args.seed}:{step}")
    long = args.long_length and step >= args.long_from * args.steps
    length = args.long_length if long else args.length
    count = max(1, args.batch * args.length // length)
    facts = 2 if step < args.few_needles_until * args.steps else args.needles
    samples = []
    for _ in range(count):
        task, seed = rng.choices(args.tasks, args.weights)[0], probe_data.TRAIN_SEED_BASE + rng.randrange(10 ** 9)
        samples.append((task, seed, facts) if facts and task in generators.COUNTED_TASKS else (task, seed))
    return length, samples


@torch.no_grad()
def value_digit_accuracy(args: argparse.Namespace, model, tok, task: str, length: int) -> float:
    """Teacher-forced accuracy of the answer's digits on the held-out seeds (in the trained answer format)."""
    mb = probe_data.MicroBatches([(length, [(task, seed) for seed in range(args.eval_n)])], 0.0, args.spell_names,
                                 args.restate_key)[0]
    hidden = model.model(input_ids=mb["input_ids"]).last_hidden_state  # [B, T, H]
    logits = model.lm_head(hidden.reshape(-1, hidden.shape[-1])[mb["positions"]])  # [N, V]
    digits = torch.tensor([t.isdigit() for t in tok.convert_ids_to_tokens(mb["labels"].tolist())])
    right = (logits.argmax(-1) == mb["labels"]) & digits
    return float(right.sum() / digits.sum().clamp(min=1))


def evaluate(args: argparse.Namespace, model, tok) -> dict[tuple[str, int], str]:
    model.eval()
    rows = {}
    for task in args.eval_tasks.split(","):
        for length in (int(n) for n in args.eval_lens.split(",")):
            scores, asked, distractor = [], 0, 0
            for seed in range(args.eval_n):
                sample = generators.make_sample(task, tok, length, seed)
                out = tok.decode(greedy(model, sample.prompt_ids, sample.max_new_tokens, tok.eos_token_id,
                                        torch.device("cpu")), skip_special_tokens=True)
                scores.append(generators.score_output(sample, out))
                values = re.findall(r"\d{7}", "".join(tok.decode(sample.prompt_ids).split()))
                digits = "".join(out.split())
                asked += sample.answers[0] in digits
                distractor += any(v in digits for v in values if v not in sample.answers)
            text = f"{sum(scores) / len(scores):.2f}"
            if task == "niah_multikey":
                text += f" (distractor {distractor / args.eval_n:.2f})"
            text += f" digits-tf {value_digit_accuracy(args, model, tok, task, length):.2f}"
            rows[(task, length)] = text
            print(f"eval {task} {length}: {text}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    tok = build_probe_tokenizer(spell_names=args.spell_names)
    model_args = argparse.Namespace(hidden=args.hidden, intermediate=2 * args.hidden, layers=args.layers,
                                    heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, seed=args.seed)
    if args.init:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32, attn_implementation="sdpa")
    else:
        model = build_model(model_args, tok)
    if args.steps == 0:
        evaluate(args, model, tok)
        return
    qk = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    rest = [p for p in model.parameters() if all(p is not q for q in qk)]
    optimizer = torch.optim.AdamW([{"params": rest, "lr_mult": 1.0}, {"params": qk, "lr_mult": args.qk_norm_lr_mult}],
                                  lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    shape = f"{model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}"
    print(f"trial: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters ({shape}); {vars(args)}",
          flush=True)
    device, t0, window = torch.device("cpu"), time.time(), [0, 0, 0]
    model.train()
    for step in range(args.steps):
        mb = probe_data.MicroBatches([step_plan(args, step)], args.tail_weight, args.spell_names, args.restate_key)[0]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args) * group["lr_mult"]
        _, right = micro_step(model, mb, device, 1.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window = [window[0] + int(right), window[1] + int(mb["answer"].sum()), window[2] + mb["tokens"]]
        if (step + 1) % args.log_every == 0:
            elapsed = time.time() - t0
            print(f"step {step + 1} len {mb['length']} answer_acc {window[0] / window[1]:.3f} "
                  f"tok/s {window[2] / max(1e-9, elapsed - getattr(main, 'last', 0)):,.0f} elapsed {elapsed:.0f}s",
                  flush=True)
            main.last, window = elapsed, [0, 0, 0]
    evaluate(args, model, tok)
    print(f"done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
