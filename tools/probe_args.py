"""tools/train_probe.py's options: one stage's, and the further stages of --then, each checked before any work."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

from probe_data import TASK_WEIGHTS, parse_task_weights

TOOLS = Path(__file__).resolve().parent
# the whole run's options, which --then stages take from the first stage
RUN_FIELDS = ("out", "device", "workers", "time_limit_min", "eval_samples")
SHAPE_FIELDS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "rope_theta")  # weights carry on
# the committed checkpoint's run (docs/probe.md): the defaults stopped at step 1,120, then the variable-tracking stage
# and the stage at every length; --recipe puts these options first, so the options given with it win
RECIPE = ("--seed", "0", "--stop-step", "1120", "--time-limit-min", "10", "--eval-samples", "0",
          "--then", "--seed 1 --steps 500 --short-frac 0.3 --ramp 0.2 --lr 5e-4 --warmup 50 "
                    "--task-weights variable_tracking=4",
          "--then", "--seed 2 --steps 450 --short-frac 0 --ramp 0.01 --lr 1.5e-4 --warmup 10 --frontier-share 0.7")


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description="Train the probe checkpoint (tools/train_probe.py).")
    p.add_argument("--recipe", action="store_true",
                   help="the committed checkpoint's three stages in one run (probe_args.RECIPE); options given with "
                        "it override its first stage's, and a --then adds a fourth stage")
    p.add_argument("--out", default=str(TOOLS.parent / "sparsekv" / "checkpoints" / "probe"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1300, help="the plan's steps (the schedule spans them)")
    p.add_argument("--stop-step", type=int, default=None,
                   help="stop after this many steps of the plan (the recipe's first stage: 1120)")
    p.add_argument("--max-len", type=int, default=32768, help="longest context, in tokens")
    p.add_argument("--min-len", type=int, default=512, help="shortest context, in tokens")
    p.add_argument("--tasks", default=",".join(TASK_WEIGHTS), help="comma-separated tasks to train on")
    p.add_argument("--task-weights", default="", help="task=weight,... overriding the mix of probe_data.TASK_WEIGHTS")
    p.add_argument("--short-len", type=int, default=None,
                   help="longest context of the short phase (default 2048, or --max-len when that is shorter)")
    p.add_argument("--short-frac", type=float, default=0.55,
                   help="fraction of the steps spent at --min-len to --short-len before the ramp")
    p.add_argument("--ramp", type=float, default=0.2,
                   help="fraction of the steps over which the longest length doubles from --short-len to --max-len")
    p.add_argument("--frontier-share", type=float, default=0.5,
                   help="share of micro-batches drawn from the top two octaves reached (the rest: any length reached)")
    p.add_argument("--micro-tokens", type=int, default=32768, help="prompt tokens per micro-batch (>= --max-len)")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--init-from", default=None,
                   help="start from this checkpoint (a fine-tune); its shape replaces --hidden ... --rope-theta")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--tail-weight", type=float, default=0.25,
                   help="loss weight of the question and answer prefix (the answer's is 1)")
    p.add_argument("--qk-norm-lr-mult", type=float, default=5.0, help="learning-rate factor of the QK-norm weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workers", type=int, default=max(0, min(14, (os.cpu_count() or 1) - 2)))
    p.add_argument("--time-limit-min", type=float, default=9.0, help="the whole run, evaluation and save included")
    p.add_argument("--eval-samples", type=int, default=3,
                   help="held-out samples per task and length at the end (0: no end-of-run check)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--then", action="append", default=[], metavar="OPTIONS",
                   help="a further stage (repeatable): these options, quoted (--then=\"...\" when they start with "
                        "--name=value), over the defaults; it continues the weights with a fresh optimizer and "
                        "schedule, as --init-from on the saved checkpoint would")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--recipe" in argv:
        argv = [*RECIPE, *argv]
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    if args.short_len is None:
        args.short_len = min(2048, args.max_len)
    try:
        args.task_weights = parse_task_weights(args.task_weights)
    except ValueError as exc:
        p.error(str(exc))
    unknown = [t for t in args.tasks if t not in args.task_weights]
    if unknown or not args.tasks:
        p.error(f"--tasks {','.join(unknown) or '(none)'}: choose from {','.join(args.task_weights)}")
    checks = [(args.steps >= 1, "--steps must be >= 1"), (args.accum >= 1, "--accum must be >= 1"),
              (args.min_len <= args.max_len, f"--min-len {args.min_len} exceeds --max-len {args.max_len}"),
              (args.micro_tokens >= args.max_len, f"--micro-tokens {args.micro_tokens} is below --max-len "
                                                  f"{args.max_len}; raise it to at least --max-len"),
              (0 < args.ramp <= 1, f"--ramp {args.ramp} must be in (0, 1]"),
              (args.min_len <= args.short_len <= args.max_len, f"--short-len {args.short_len} must lie between "
                                                              f"--min-len {args.min_len} and --max-len {args.max_len}"),
              (0 <= args.short_frac and args.short_frac + args.ramp <= 1,
               f"--short-frac {args.short_frac} + --ramp {args.ramp} must lie in [0, 1]"),
              (0 <= args.frontier_share <= 1, f"--frontier-share {args.frontier_share} must be in [0, 1]"),
              (args.heads % args.kv_heads == 0, f"--heads {args.heads} must be a multiple of --kv-heads "
                                                f"{args.kv_heads}"),
              (args.max_len + 64 <= 65536, f"--max-len {args.max_len} leaves no room for the answer below 65536 "
                                           "positions"),
              (args.time_limit_min > 0, "--time-limit-min must be > 0"), (args.workers >= 0, "--workers >= 0"),
              (args.eval_samples >= 0, f"--eval-samples {args.eval_samples} must be >= 0"),
              (args.stop_step is None or 1 <= args.stop_step <= args.steps,
               f"--stop-step {args.stop_step} must lie between 1 and --steps {args.steps}"),
              (sum(args.task_weights[t] for t in args.tasks) > 0,
               "the --tasks all weigh 0: give one a weight with --task-weights")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    args.stages = [args]
    whole_run = {"--" + f.replace("_", "-") for f in (*RUN_FIELDS, *SHAPE_FIELDS, "init_from", "then", "recipe")}
    for text in args.then:
        words = shlex.split(text)
        taken = sorted({w.split("=")[0] for w in words} & whole_run)
        if taken:
            p.error(f"--then {text!r}: {', '.join(taken)}: options of the whole run; give them outside --then")
        args.stages.append(parse_args(words, prog=f"{p.prog} --then {text!r}"))
    return args
