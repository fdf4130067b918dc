"""Train the probe checkpoint: a small Qwen3 that answers the RULER generators' tasks from 1K to 32K tokens.

    python3 tools/train_probe.py --recipe --out /tmp/probe  # the committed checkpoint's stages: 8 minutes of one H100
    python3 tools/train_probe.py --out /tmp/base --seed 0 --stop-step 1120  # its first stage alone, about 5 minutes
    python3 tools/train_probe.py --out /tmp/next --init-from /tmp/base ...  # continue a checkpoint

The data is the generators' own samples (sparsekv/tasks/ruler), with the probe tokenizer (tools/probe_tokenizer.py).
The loss is on the answer (the tokens after the answer prefix, then EOS) and, at --tail-weight, on the question and
answer prefix; the haystack carries none. A step is --accum micro-batches of about --micro-tokens tokens each; a
micro-batch holds samples of one context length (short ones: many samples), drawn from a length curriculum: the
first --short-frac of the steps stay at --min-len to --short-len, then the longest length doubles up to --max-len
over the next --ramp of the steps; --frontier-share of the draws come from the top two octaves reached, the rest
from any length reached. The tasks are the suite's and kv_adjacent (key matching in its plainest form,
probe_data.kv_adjacent_sample). The defaults are the committed checkpoint's first stage (docs/probe.md). The plan's time
by the cost model of docs/probe.md is printed before training. DataLoader workers build the samples. Training seeds
are >= TRAIN_SEED_BASE (10**9); evaluation (task=ruler, and the sanity check at the end here) uses seeds below it.
The steps, lengths, tasks and sample seeds are a pure function of --seed and the arguments, and so are the weights,
bit for bit on the same GPU model and software: deterministic kernels only (torch.use_deterministic_algorithms),
on CUDA with the decoder layers compiled; training.json records weights_sha256. --init-from continues
a checkpoint (same tokenizer, its shape) and nests its training.json under init_from_record. --time-limit-min caps
the whole run (training stops early, saves, then evaluates). Saved: config.json (bfloat16), safetensors shards of at
most 15 MB, the tokenizer, training.json. docs/probe.md has the design and the time estimate.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

TOOLS = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS.parent), str(TOOLS)]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS repeats its sums only with this, set before CUDA

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from probe_args import RUN_FIELDS, SHAPE_FIELDS, parse_args  # noqa: E402
from probe_data import TRAIN_SEED_BASE, make_loader, micro_plan, plan_summary, training_sample  # noqa: E402
from probe_eval import evaluate  # noqa: E402
from probe_tokenizer import build_probe_tokenizer  # noqa: E402

CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json", "training.json")
EVAL_RESERVE_S = 60.0  # of --time-limit-min kept for the evaluation and the save
SAVE_RESERVE_S = 15.0  # ... for the save alone (--eval-samples 0)


def build_model(args: argparse.Namespace, tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3Config

    if args.init_from:
        return load_model(args, tokenizer)

    dims = dict(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=args.hidden,
                intermediate_size=args.intermediate, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=65536,
                rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, use_cache=True)
    try:
        config = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta}, **dims)
    except TypeError:  # a transformers release before rope_parameters
        config = Qwen3Config(rope_theta=args.rope_theta, **dims)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def load_model(args: argparse.Namespace, tokenizer):
    """--init-from's checkpoint in float32, after checking it was trained with this tokenizer; the shape options
    take its values, so the record and the time estimate describe the model trained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(args.init_from).expanduser()
    if not (source / "config.json").is_file():
        sys.exit(f"--init-from {source}: no config.json there; pass a checkpoint directory")
    if AutoTokenizer.from_pretrained(str(source)).get_vocab() != tokenizer.get_vocab():
        sys.exit(f"--init-from {source}: its tokenizer differs from tools/probe_tokenizer.py's; token ids would "
                 "not match: train from scratch instead")
    model = AutoModelForCausalLM.from_pretrained(str(source), attn_implementation="sdpa", dtype=torch.float32)
    c = model.config
    args.hidden, args.intermediate, args.layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    args.heads, args.kv_heads, args.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rope = getattr(c, "rope_parameters", None) or {}
    args.rope_theta = rope.get("rope_theta", getattr(c, "rope_theta", args.rope_theta))
    return model


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


def micro_step(model, mb: dict, device: torch.device, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of one micro-batch, its answer loss scaled by `scale`; (loss sum, correct count)."""
    input_ids = mb["input_ids"].to(device, non_blocking=True)  # [B, T]
    positions = mb["positions"].to(device, non_blocking=True)  # [N] into B * T
    labels = mb["labels"].to(device, non_blocking=True)  # [N]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, T, H]
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)  # [N, H]
        logits = model.lm_head(picked).float()  # [N, V]
    weights = mb["weights"].to(device, non_blocking=True)  # [N]: 1 on the answer, --tail-weight before it
    answer = mb["answer"].to(device, non_blocking=True)  # [N]
    losses = F.cross_entropy(logits, labels, reduction="none")  # [N]
    ((losses * weights).sum() * scale / answer.sum().clamp(min=1)).backward()
    return (losses * answer).sum().detach(), ((logits.argmax(-1) == labels) & answer).sum()


def random_micro(length: int, args: argparse.Namespace, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(length)
    count = max(1, args.micro_tokens // length)
    return {"input_ids": torch.randint(4, vocab, (count, length), generator=generator),
            "positions": torch.arange(length - 40, length - 1), "labels": torch.randint(4, vocab, (39,)),
            "weights": torch.ones(39), "answer": torch.ones(39, dtype=torch.bool)}


def fast_attention(model, args: argparse.Namespace, device: torch.device, plans: list, budget_s: float) -> Callable:
    """On CUDA, attention must run in a flash/efficient kernel: the math fallback needs tens of GB at 32K. One
    forward and backward at each end of the lengths checks that (HF's GQA path first, then with K/V repeated),
    times them and estimates the training time of every stage's plan (`plans`), with a warning when it exceeds
    budget_s (the time left before training must stop). Returns the context manager for the steps."""
    if device.type != "cuda":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def context():
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])

    def seconds(length: int) -> float:
        mb = random_micro(length, args, model.config.vocab_size)
        for _ in range(2):  # the first one warms up
            torch.cuda.synchronize()
            start = time.time()
            with context():
                micro_step(model, mb, device, 1.0)
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return time.time() - start

    import transformers.integrations.sdpa_attention as hf_sdpa

    for attempt in ("GQA in SDPA", "K/V repeated"):
        try:
            short, long = seconds(args.min_len), seconds(args.max_len)
            break
        except RuntimeError as exc:
            model.zero_grad(set_to_none=True)
            print(f"preflight: no fast attention kernel with {attempt} ({str(exc).splitlines()[0][:120]})", flush=True)
            hf_sdpa.use_gqa_in_sdpa = lambda *_, **__: False
    else:
        print("preflight: warning: attention may fall back to the math kernel (slow, much memory at 32K)", flush=True)
        return contextlib.nullcontext
    for line in preflight_report(plans, (args.min_len, short), (args.max_len, long), args.accum, budget_s):
        print(f"preflight: {line}", flush=True)
    return context


def preflight_report(plans: list, short: tuple[int, float], long: tuple[int, float], accum: int,
                     budget_s: float) -> list[str]:
    """The training time of the stages' plans (micro-batches of (length, samples)) from two timed micro-batches
    (length, seconds), linear in the length, and a warning naming the fix when it exceeds budget_s."""
    span = max(1, long[0] - short[0])
    per_stage = [sum(short[1] + (long[1] - short[1]) * (length - short[0]) / span for length, _ in plan)
                 for plan in plans]
    total = sum(per_stage)
    lines = [f"a micro-batch takes {short[1]:.3f} s at length {short[0]}, {long[1]:.3f} s at {long[0]}; "
             f"{sum(map(len, plans))} micro-batches: about {total:.0f} s of training"
             + (f" ({' + '.join(f'{s:.0f}' for s in per_stage)} s by stage)" if len(plans) > 1 else "")]
    if total <= budget_s:
        return lines
    head = f"warning: {total:.0f} s exceed the {budget_s:.0f} s --time-limit-min leaves for training; "
    if len(plans) == 1:
        fitting = int(len(plans[0]) / accum * budget_s / total)
        return lines + [head + f"the run will stop early: pass --stop-step {fitting} (or fewer --steps)"]
    before = 0.0
    for number, (plan, seconds) in enumerate(zip(plans, per_stage), 1):
        if before + seconds > budget_s:
            fitting = int(len(plan) / accum * max(0.0, budget_s - before) / seconds)
            return lines + [head + f"stage {number} of {len(plans)} would stop after about {fitting} of its "
                            f"{len(plan) // accum} steps: shorten the stages (--steps / --stop-step in each --then)"]
        before += seconds
    return lines


def train(args: argparse.Namespace, model, loader, device: torch.device, attention: Callable, deadline: float,
          t0: float) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    # QK-norm weights alone set how sharp attention can get (logits <= sqrt(head_dim) * |w_q| * |w_k|); picking
    # one needle among 32K tokens needs them well above their init of 1, so they learn faster
    qk = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    rest = [p for p in params if all(p is not q for q in qk)]
    groups = [{"params": rest, "lr_mult": 1.0}, {"params": qk, "lr_mult": args.qk_norm_lr_mult}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  **({"fused": True} if device.type == "cuda" else {}))
    model.train()
    batches = iter(loader)
    window = {"loss": 0.0, "correct": 0, "targets": 0, "tokens": 0, "lengths": [], "t": time.time()}
    skipped, step = 0, 0
    last = args.stop_step or args.steps
    for step in range(last):
        micros = [next(batches) for _ in range(args.accum)]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args) * group["lr_mult"]
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        for mb in micros:
            with attention():  # each micro-batch weighs the same: one 32K sample as much as 64 short ones
                loss, right = micro_step(model, mb, device, 1.0 / args.accum)
            loss_sum += loss
            correct += right
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
        window["targets"] += sum(int(mb["answer"].sum()) for mb in micros)
        now = time.time()
        if (step + 1) % args.log_every == 0 or step + 1 == last or now > deadline:
            lengths = window["lengths"]
            print(f"step {step + 1}/{args.steps} len {min(lengths)}-{max(lengths)} "
                  f"loss {window['loss'] / window['targets']:.4f} "
                  f"answer_acc {window['correct'] / window['targets']:.3f} lr {learning_rate(step, args):.2e} "
                  f"tok/s {window['tokens'] / max(now - window['t'], 1e-9):,.0f} elapsed {now - t0:.0f}s", flush=True)
            window = {"loss": 0.0, "correct": 0, "targets": 0, "tokens": 0, "lengths": [], "t": now}
        if now > deadline and step + 1 < last:
            print(f"stopped early at step {step + 1} of {args.steps}: --time-limit-min {args.time_limit_min} "
                  f"reached (the checkpoint is saved as it is)", flush=True)
            return {"steps_done": step + 1, "stopped_early": True}
    return {"steps_done": step + 1, "stopped_early": False}


@contextlib.contextmanager
def deterministic_kernels():
    """Every kernel of the training is one that sums in a fixed order (on CUDA: flash attention, not cuDNN's, whose
    backward is not), so a seed gives the same weights bit for bit on the same GPU model and software; an op without
    such a kernel stops the run naming itself."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def compile_layers(model) -> None:
    """Compile the decoder layers and the final norm for any batch and length (dynamic shapes): their norms, rotary
    and MLP gating fuse into few kernels (eager, a micro-batch is mostly small elementwise ops), with Inductor's
    kernel configurations chosen without timing them, so they are the same in every run."""
    torch._inductor.config.deterministic = True
    for module in (*model.model.layers, model.model.norm):
        module.compile(dynamic=True)


def weights_digest(model) -> str:
    """SHA-256 of the weights as saved (names, dtypes, shapes, bytes): equal digests mean bitwise-equal runs."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


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
    config["torch_dtype"] = "bfloat16"  # older readers' key; transformers 5 writes "dtype"
    config["dtype"] = "bfloat16"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shards = sorted(out.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in out.iterdir())
    largest = max(p.stat().st_size for p in shards)
    print(f"saved {out}: {len(shards)} safetensors shard(s), largest {largest / 2**20:.1f} MiB, "
          f"{total / 2**20:.1f} MiB in all", flush=True)
    if total > 32 * 2**20 or largest > 15 * 10**6:
        print("warning: the checkpoint exceeds its budget (32 MiB in all, 15 MB a shard); shrink --hidden, "
              "--intermediate or --layers", flush=True)


def main(argv: list[str] | None = None) -> None:
    t0 = time.time()
    args = parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    check_out_dir(out)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: CUDA is not available here; pass --device cpu")
    tokenizer = build_probe_tokenizer()
    for stage in args.stages:  # every task must fit the shortest length before the workers start
        for task in stage.tasks:
            try:
                training_sample(task, tokenizer, stage.min_len, 0)
            except ValueError as exc:
                sys.exit(f"--min-len {stage.min_len} is too small: {exc}")
    hard_stop = t0 + args.time_limit_min * 60
    reserve = EVAL_RESERVE_S if args.eval_samples else SAVE_RESERVE_S
    deadline = hard_stop - min(reserve, args.time_limit_min * 60 * 0.2)
    model = build_model(args, tokenizer).to(device)
    if device.type == "cuda":
        compile_layers(model)
    for stage in args.stages[1:]:  # the whole run's options and the shape the first stage built or loaded
        for field in (*RUN_FIELDS, *SHAPE_FIELDS):
            setattr(stage, field, getattr(args, field))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"probe: {n_params / 1e6:.2f}M parameters, {args.layers} layers, hidden {args.hidden}, heads "
          f"{args.heads}/{args.kv_heads}x{args.head_dim}; {args.steps} steps x {args.accum} micro-batches of "
          f"{args.micro_tokens} tokens, lengths {args.min_len}-{args.max_len}; device {device}, "
          f"{args.workers} data workers", flush=True)
    record: dict | None = None
    if args.init_from:  # the lineage: the record of the run this one continued, and of the runs before it
        source_record = Path(args.init_from).expanduser() / "training.json"
        record = json.loads(source_record.read_text()) if source_record.is_file() else None
    plans = [micro_plan(stage)[:(stage.stop_step or stage.steps) * stage.accum] for stage in args.stages]
    attention = None
    for number, (stage, plan) in enumerate(zip(args.stages, plans), 1):  # a plan: the steps its stage takes
        stage_t0 = time.time()
        print(f"{f'stage {number} of {len(args.stages)}: ' if len(args.stages) > 1 else ''}plan: "
              f"{plan_summary(plan, stage.micro_tokens)}", flush=True)
        loader = make_loader(plan, stage.workers, pin=device.type == "cuda", tail_weight=stage.tail_weight)
        with deterministic_kernels():  # the preflight too: it finds the kernels training gets
            if attention is None:
                attention = fast_attention(model, stage, device, plans, deadline - time.time())
            progress = train(stage, model, loader, device, attention, deadline, t0)
        last = number == len(args.stages) or progress["stopped_early"]
        with torch.no_grad():  # as saved: bfloat16 (a next stage continues from these values, as after a reload)
            for param in model.parameters():  # parameters only: the rotary inv_freq buffer stays float32
                param.data = param.data.to(torch.bfloat16) if last else param.data.to(torch.bfloat16).float()
        stage_record = {"args": {k: v for k, v in vars(stage).items() if k not in ("out", "stages")}, **progress,
                        "train_seed_base": TRAIN_SEED_BASE,
                        "train_seconds": round(time.time() - (t0 if number == 1 else stage_t0), 1)}
        if record is not None:
            stage_record["init_from_record"] = record
        record = stage_record
        if last:
            if number < len(args.stages):
                print(f"stages {number + 1}-{len(args.stages)} not run: --time-limit-min reached", flush=True)
            break
    record["weights_sha256"] = weights_digest(model)
    print(f"weights sha256 {record['weights_sha256']}", flush=True)
    save(model, tokenizer, out, record)  # before the evaluation, which only adds its scores
    if args.eval_samples:
        try:
            with torch.compiler.set_stance("force_eager"):  # generation's shapes and cache: no recompiles
                results = evaluate(args, model, tokenizer, device, hard_stop)
            record["eval"] = {task: {str(n): score for n, score in row.items()} for task, row in results.items()}
            record["eval_seeds"] = list(range(args.eval_samples))
            (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        except Exception as exc:  # the checkpoint is saved; a failing sanity check must not lose it
            print(f"evaluation failed ({type(exc).__name__}: {exc}); the checkpoint is saved, run task=ruler",
                  flush=True)
    print(f"done in {time.time() - t0:.0f}s{' (stopped early)' if progress['stopped_early'] else ''}; "
          "prove it with task=ruler (docs/probe.md)", flush=True)


if __name__ == "__main__":
    main()
