"""Train the probe checkpoint: a small Qwen3 that answers the RULER generators' tasks from 512 to 32K tokens.

    python3 tools/train_probe.py --out sparsekv/checkpoints/probe --seed 0     # one H100, about 7-9 minutes

The data is the generators' own samples (sparsekv/tasks/ruler), with the probe tokenizer (tools/probe_tokenizer.py).
The loss is on the answer only: the tokens after the answer prefix, then EOS. A step is --accum micro-batches
of about --micro-tokens tokens each; a micro-batch holds samples of one context length (short ones: many
samples), drawn from a length curriculum whose longest length doubles from --min-len up to --max-len over
the first --ramp of the steps; half of the draws then come from the top two octaves reached. DataLoader workers
build the samples. Training seeds are >= TRAIN_SEED_BASE (10**9); evaluation (task=ruler, and the sanity check
at the end here) uses seeds below it. The steps, lengths, tasks and sample seeds are a pure function of
--seed and the arguments. --time-limit-min caps the whole run (training stops early, then evaluates and saves).
Saved: config.json (bfloat16), safetensors shards of at most 15 MB, the tokenizer, training.json.
docs/probe.md has the design and the time estimate.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS.parent), str(TOOLS)]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from probe_tokenizer import build_probe_tokenizer  # noqa: E402
from sparsekv.tasks.ruler.generators import TASKS, answer_text, make_sample, score_output  # noqa: E402

TRAIN_SEED_BASE = 10 ** 9
TASK_WEIGHTS = {"niah_single": 1.0, "niah_multikey": 1.5, "niah_multivalue": 1.5, "niah_multiquery": 1.5,
                "variable_tracking": 2.0, "common_words": 0.75}
EVAL_LENGTHS = (2048, 8192, 32768)
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json", "training.json")
EVAL_RESERVE_S = 60.0  # of --time-limit-min kept for the evaluation and the save


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(TOOLS.parent / "sparsekv" / "checkpoints" / "probe"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--max-len", type=int, default=32768, help="longest context, in tokens")
    p.add_argument("--min-len", type=int, default=512, help="shortest context, in tokens")
    p.add_argument("--ramp", type=float, default=0.4, help="fraction of the steps over which lengths reach --max-len")
    p.add_argument("--micro-tokens", type=int, default=32768, help="prompt tokens per micro-batch (>= --max-len)")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--qk-norm-lr-mult", type=float, default=10.0, help="learning-rate factor of the QK-norm weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workers", type=int, default=max(0, min(14, (os.cpu_count() or 1) - 2)))
    p.add_argument("--time-limit-min", type=float, default=9.0, help="the whole run, evaluation and save included")
    p.add_argument("--eval-samples", type=int, default=3, help="held-out samples per task and length at the end")
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    checks = [(args.steps >= 1, "--steps must be >= 1"), (args.accum >= 1, "--accum must be >= 1"),
              (args.min_len <= args.max_len, f"--min-len {args.min_len} exceeds --max-len {args.max_len}"),
              (args.micro_tokens >= args.max_len, f"--micro-tokens {args.micro_tokens} is below --max-len "
                                                  f"{args.max_len}; raise it to at least --max-len"),
              (0 < args.ramp <= 1, f"--ramp {args.ramp} must be in (0, 1]"),
              (args.heads % args.kv_heads == 0, f"--heads {args.heads} must be a multiple of --kv-heads "
                                                f"{args.kv_heads}"),
              (args.max_len + 64 <= 65536, f"--max-len {args.max_len} leaves no room for the answer below 65536 "
                                           "positions"),
              (args.time_limit_min > 0, "--time-limit-min must be > 0"), (args.workers >= 0, "--workers >= 0")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    return args


def length_buckets(min_len: int, max_len: int) -> list[int]:
    """Powers of two and their 1.5x midpoints between min_len and max_len, both ends included."""
    grid = {min_len, max_len}
    for exp in range(6, 17):
        grid.update(x for x in (2 ** exp, 3 * 2 ** (exp - 1)) if min_len < x < max_len)
    return sorted(grid)


def micro_plan(args: argparse.Namespace) -> list[tuple[int, list[tuple[str, int]]]]:
    """Per micro-batch: its context length and its (task, seed) samples, a pure function of the arguments."""
    buckets = length_buckets(args.min_len, args.max_len)
    tasks, weights = list(TASK_WEIGHTS), list(TASK_WEIGHTS.values())
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
    """Item m: micro-batch m of the plan as input_ids [B, T] (right-padded) and the answer targets as flat
    positions into [B * T] with their token ids (the token each position must predict)."""

    def __init__(self, plan: list[tuple[int, list[tuple[str, int]]]]):
        self.plan = plan
        self.tokenizer = None

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, m: int) -> dict[str, torch.Tensor | int]:
        if self.tokenizer is None:
            self.tokenizer = build_probe_tokenizer()
        tok = self.tokenizer
        length, samples = self.plan[m]
        rows, targets = [], []
        for task, seed in samples:
            sample = make_sample(task, tok, length, seed)
            answer = tok.encode(answer_text(sample), add_special_tokens=False) + [tok.eos_token_id]
            rows.append(sample.prompt_ids + answer)
            targets.append((len(sample.prompt_ids) - 1, answer))
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        positions, labels = [], []
        for b, (row, (start, answer)) in enumerate(zip(rows, targets)):
            input_ids[b, :len(row)] = torch.tensor(row)
            positions.extend(b * width + start + i for i in range(len(answer)))
            labels.extend(answer)
        return {"input_ids": input_ids, "positions": torch.tensor(positions), "labels": torch.tensor(labels),
                "length": length, "tokens": sum(len(r) for r in rows)}


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)


def make_loader(plan, workers: int, pin: bool):
    import multiprocessing

    extra = {}
    if workers:
        context = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        extra = dict(prefetch_factor=4, worker_init_fn=_worker_init, multiprocessing_context=context)
    return torch.utils.data.DataLoader(MicroBatches(plan), batch_size=None, shuffle=False, num_workers=workers,
                                       pin_memory=pin, **extra)


def build_model(args: argparse.Namespace, tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3Config

    dims = dict(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=args.hidden,
                intermediate_size=args.intermediate, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=65536,
                rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, use_cache=True)
    try:
        config = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **dims)
    except TypeError:  # a transformers release before rope_parameters
        config = Qwen3Config(rope_theta=1e6, **dims)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of --lr at the last step."""
    warmup = min(args.warmup, max(1, args.steps // 10))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def check_out_dir(out: Path) -> None:
    """--out may be new, empty or an earlier probe checkpoint (replaced); anything else is refused."""
    if out.exists() and not out.is_dir():
        sys.exit(f"--out {out} is a file; pass a directory for the checkpoint")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if p.name not in CHECKPOINT_FILES and p.suffix != ".safetensors"]
        if foreign:
            sys.exit(f"--out {out} holds files that are not a probe checkpoint ({', '.join(sorted(foreign)[:4])}); "
                     "pass a new or empty directory")


def train(args: argparse.Namespace, model, loader, device: torch.device, deadline: float, t0: float) -> dict:
    use_amp = device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    # QK-norm weights alone set how sharp attention can get (logits <= sqrt(head_dim) * |w_q| * |w_k|); picking
    # one needle among 32K tokens needs them well above their init of 1, so they learn faster
    qk = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    rest = [p for p in params if all(p is not q for q in qk)]
    groups = [{"params": rest, "lr_mult": 1.0}, {"params": qk, "lr_mult": args.qk_norm_lr_mult}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  **({"fused": True} if use_amp else {}))
    model.train()
    batches = iter(loader)
    window = {"loss": 0.0, "correct": 0, "targets": 0, "tokens": 0, "lengths": [], "t": time.time()}
    skipped, step = 0, 0
    for step in range(args.steps):
        micros = [next(batches) for _ in range(args.accum)]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args) * group["lr_mult"]
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        for mb in micros:
            input_ids = mb["input_ids"].to(device, non_blocking=True)  # [B, T]
            positions = mb["positions"].to(device, non_blocking=True)  # [N] into B * T
            labels = mb["labels"].to(device, non_blocking=True)  # [N]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, T, H]
                picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)  # [N, H]
                logits = model.lm_head(picked).float()  # [N, V]
            loss = F.cross_entropy(logits, labels, reduction="sum")
            # each micro-batch weighs the same: one 32K-token sample counts as much as 64 short ones
            (loss / (len(labels) * args.accum)).backward()
            loss_sum += loss.detach()
            correct += (logits.argmax(-1) == labels).sum()
            window["tokens"] += mb["tokens"]
            window["lengths"].append(mb["length"])
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if torch.isfinite(norm):
            optimizer.step()
        else:
            skipped += 1
            print(f"step {step}: non-finite gradient norm, update skipped ({skipped} so far)", flush=True)
            if skipped > 10:
                raise RuntimeError("more than 10 non-finite gradients: lower --lr")
        optimizer.zero_grad(set_to_none=True)
        window["loss"] += float(loss_sum)
        window["correct"] += int(correct)
        window["targets"] += sum(len(mb["labels"]) for mb in micros)
        now = time.time()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps or now > deadline:
            lengths = window["lengths"]
            print(f"step {step + 1}/{args.steps} len {min(lengths)}-{max(lengths)} "
                  f"loss {window['loss'] / window['targets']:.4f} "
                  f"answer_acc {window['correct'] / window['targets']:.3f} lr {learning_rate(step, args):.2e} "
                  f"tok/s {window['tokens'] / max(now - window['t'], 1e-9):,.0f} elapsed {now - t0:.0f}s", flush=True)
            window = {"loss": 0.0, "correct": 0, "targets": 0, "tokens": 0, "lengths": [], "t": now}
        if now > deadline and step + 1 < args.steps:
            print(f"stopped early at step {step + 1} of {args.steps}: --time-limit-min {args.time_limit_min} "
                  f"reached (the checkpoint is saved as it is)", flush=True)
            return {"steps_done": step + 1, "stopped_early": True}
    return {"steps_done": step + 1, "stopped_early": False}


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int, device: torch.device) -> list[int]:
    import warnings

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
    for task in TASKS:
        for length in lengths:
            scores = []
            for seed in range(args.eval_samples):
                if time.time() > hard_stop:
                    print("evaluation cut short by --time-limit-min", flush=True)
                    return results
                sample = make_sample(task, tokenizer, length, seed)
                output = greedy(model, sample.prompt_ids, sample.max_new_tokens, tokenizer.eos_token_id, device)
                scores.append(score_output(sample, tokenizer.decode(output, skip_special_tokens=True)))
            results.setdefault(task, {})[length] = sum(scores) / len(scores)
    print("held-out accuracy (mean score, greedy) by context length:", flush=True)
    print(f"  {'task':<18}" + "".join(f"{n:>8}" for n in lengths))
    for task, row in results.items():
        print(f"  {task:<18}" + "".join(f"{row.get(n, float('nan')):8.2f}" for n in lengths), flush=True)
    return results


def save(model, tokenizer, out: Path, record: dict) -> None:
    if out.is_dir():
        for path in out.iterdir():
            if path.name in CHECKPOINT_FILES or path.suffix == ".safetensors":
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size="15MB")
    tokenizer.save_pretrained(str(out))
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config["torch_dtype"] = "bfloat16"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shards = sorted(out.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in out.iterdir())
    largest = max(p.stat().st_size for p in shards)
    print(f"saved {out}: {len(shards)} safetensors shard(s), largest {largest / 2**20:.1f} MiB, "
          f"{total / 2**20:.1f} MiB in all", flush=True)
    if total > 32 * 2**20 or largest > 15 * 10**6:
        print(f"warning: the checkpoint exceeds its budget (32 MiB in all, 15 MB a shard); shrink --hidden, "
              f"--intermediate or --layers", flush=True)


def main(argv: list[str] | None = None) -> None:
    t0 = time.time()
    args = parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    check_out_dir(out)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: CUDA is not available here; pass --device cpu")
    tokenizer = build_probe_tokenizer()
    for task in TASKS:  # every task must fit the shortest length before the workers start
        try:
            make_sample(task, tokenizer, args.min_len, 0)
        except ValueError as exc:
            sys.exit(f"--min-len {args.min_len} is too small: {exc}")
    plan = micro_plan(args)
    loader = make_loader(plan, args.workers, pin=device.type == "cuda")
    hard_stop = t0 + args.time_limit_min * 60
    deadline = hard_stop - min(EVAL_RESERVE_S, args.time_limit_min * 60 * 0.2)
    model = build_model(args, tokenizer).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"probe: {n_params / 1e6:.2f}M parameters, {args.layers} layers, hidden {args.hidden}, heads "
          f"{args.heads}/{args.kv_heads}x{args.head_dim}; {args.steps} steps x {args.accum} micro-batches of "
          f"{args.micro_tokens} tokens, lengths {args.min_len}-{args.max_len}; device {device}, "
          f"{args.workers} data workers", flush=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    progress = train(args, model, loader, device, deadline, t0)
    model.to(torch.bfloat16)
    results = evaluate(args, model, tokenizer, device, hard_stop)
    record = {"args": {k: v for k, v in vars(args).items() if k != "out"}, **progress,
              "train_seed_base": TRAIN_SEED_BASE, "eval_seeds": list(range(args.eval_samples)),
              "eval": {task: {str(n): s for n, s in row.items()} for task, row in results.items()},
              "seconds": round(time.time() - t0, 1)}
    save(model, tokenizer, out, record)
    print(f"done in {time.time() - t0:.0f}s{' (stopped early)' if progress['stopped_early'] else ''}; "
          "prove it with task=ruler (docs/probe.md)", flush=True)


if __name__ == "__main__":
    main()
