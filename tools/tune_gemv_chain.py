"""Tune the one-row skinny GEMV per weight shape where it runs: a whole decode step's chain replayed from a CUDA graph.

Isolated do_bench timings (L2 flushed, one kernel) mis-rank kernels of 10-40 us, whose ramp-up and tail count.
This builds Qwen3-4B-shaped bf16 weights for all layers (+ lm_head, ~8 GB) and times one CUDA graph of the chain
in decode order: per layer qkv [6144 x 2560] -> o_proj [2560 x 4096] -> gate_up [19456 x 2560] -> down
[2560 x 9728] (gated: silu_mul_linear), then lm_head [151936 x 2560]; each output feeds the next input.

Candidates are gemv_configs.SHAPE_CONFIGS rows (tensor cores, BLOCK_N, BLOCK_K, num_warps, num_stages, split_k) for one
shape class while the others keep their current row: coordinate descent over BLOCK_N, BLOCK_K, num_warps,
num_stages (FMA path: > 1 pipelines the K loop with cp.async), the split rule (none / the heuristic / 2x, 4x it),
then tensor-core (tl.dot, x padded to 16 rows) rows. Round 1 holds the other shapes at today's default; round 2
(--rounds 2) at their round-1 best. Each candidate is checked against the fp32 reference on its shape first.

    python tools/tune_gemv_chain.py OUT_DIR [--model qwen3_4b] [--tp 1] [--rounds 1] [--search-pdl 1] [--quick]

--model / --tp tune another model's shapes, or one tensor-parallel rank's shards (e.g. --model qwen3_8b --tp 2).

Writes OUT_DIR/gemv_chain.jsonl (every timing) and OUT_DIR/gemv_chain_summary.txt; prints the best row per shape,
the chain with all best rows vs the default (PDL off and on), and a SHAPE_CONFIGS line to paste into gemv_configs.py.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsekv.kernels import _dispatch
from sparsekv.kernels import gemv as G
from sparsekv.kernels import gemv_configs as GC

PDL = False  # the chain's kernels launch with programmatic dependent launch (set_pdl)

HIDDEN, Q_OUT, INTER, VOCAB, LAYERS = 2560, 4096, 9728, 151936, 36  # Qwen3-4B; set_model() changes them
# shape class -> W [N, K]
SHAPES = {"qkv": (Q_OUT + 2048, HIDDEN), "o": (HIDDEN, Q_OUT), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}
MODEL_CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def set_model(name: str, tp: int) -> None:
    """The shapes one tensor-parallel rank of conf/model/NAME.yaml streams: q/k/v, gate/up and lm_head split by
    output rows, o_proj and down_proj by input columns; KV heads replicated when fewer than the ranks."""
    global HIDDEN, Q_OUT, INTER, VOCAB, LAYERS, SHAPES
    import yaml

    path = MODEL_CONF / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"--model {name}: no {path}; choose from "
                         f"{', '.join(sorted(p.stem for p in MODEL_CONF.glob('*.yaml')))}")
    m = yaml.safe_load(path.read_text())
    heads, kv_heads, d = m["num_attention_heads"], m["num_key_value_heads"], m.get("head_dim") or (
        m["hidden_size"] // m["num_attention_heads"])
    if heads % tp or m["intermediate_size"] % tp or m["vocab_size"] % tp:
        raise SystemExit(f"--tp {tp} does not divide {name}'s heads / intermediate size / vocabulary")
    kv_per_rank = max(1, kv_heads // tp)
    HIDDEN, Q_OUT, INTER = m["hidden_size"], heads // tp * d, m["intermediate_size"] // tp
    VOCAB, LAYERS = m["vocab_size"] // tp, m["num_hidden_layers"]
    SHAPES = {"qkv": (Q_OUT + 2 * kv_per_rank * d, HIDDEN), "o": (HIDDEN, Q_OUT), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}
DEFAULT_ROW = (False, 16, 256, 4, 1, None)  # CONFIGS' M = 1 row with the split heuristic: today's launch
FMA_AXES = {"block_n": (8, 16, 32), "block_k": (128, 256, 512), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4)}
AXIS_INDEX = {"block_n": 1, "block_k": 2, "num_warps": 3, "num_stages": 4}
SPLIT_RULES = ("none", "heuristic", "x2", "x4")
# tensor-core rows at M = 1: (BLOCK_N, BLOCK_K, num_warps, num_stages); the best one then sweeps its stages
DOT_ROWS = ((32, 256, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3), (16, 256, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3))
DOT_STAGES = (2, 3, 4)


def heuristic_split(n: int, k: int, row: tuple) -> int:
    """The split count the heuristic gives W [n, k] with this row's tiles (pure Python)."""
    probe = (n, k, *row[:5], None)
    saved = GC.SHAPE_CONFIGS
    try:
        GC.SHAPE_CONFIGS = (probe,)
        return GC.choose_config(1, n, k, 2, "cpu").split_k
    finally:
        GC.SHAPE_CONFIGS = saved


def with_split(n: int, k: int, row: tuple, rule: str) -> tuple:
    """row with its split field set by rule: none -> 1, heuristic -> None, xF -> F times the heuristic (>= F)."""
    heuristic = heuristic_split(n, k, row)
    if rule == "none":
        split = 1
    elif rule == "heuristic":
        split = heuristic
    else:
        split = min(GC.MAX_SPLIT_K * 4, int(rule[1:]) * heuristic)
    return (*row[:5], None if split == heuristic else split)  # one spelling per launch: no launch timed twice


def split_rule_of(n: int, k: int, row: tuple) -> str:
    if row[5] is None:
        return "heuristic"
    if row[5] == 1:
        return "none"
    return f"x{max(1, row[5] // max(1, heuristic_split(n, k, row)))}"


def axis_candidates(name: str, row: tuple, axis: str) -> list[tuple]:
    """The rows that differ from `row` in one axis (FMA rows: BLOCK_N, BLOCK_K, warps, stages, split rule;
    tensor-core rows: stages and split rule)."""
    n, k = SHAPES[name]
    rule = split_rule_of(n, k, row)
    out = []
    if axis == "split":
        out = [with_split(n, k, row, r) for r in SPLIT_RULES]
    elif axis == "dot":
        out = [with_split(n, k, (True, *d), rule if rule != "none" else "heuristic") for d in DOT_ROWS]
    elif row[0] and axis == "num_stages":
        out = [with_split(n, k, (*row[:4], s), rule) for s in DOT_STAGES]
    elif not row[0]:
        i = AXIS_INDEX[axis]
        out = [with_split(n, k, (*row[:i], v, *row[i + 1:5]), rule) for v in FMA_AXES[axis]]
    return [r for r in dict.fromkeys(out) if r != row]


def shape_configs(rows: dict[str, tuple]) -> tuple:
    """SHAPE_CONFIGS for {shape class: row}; the default row is left out (CONFIGS gives it)."""
    return tuple((*SHAPES[name], *row) for name, row in rows.items() if row != DEFAULT_ROW)


def describe(row: tuple) -> str:
    dot, bn, bk, warps, stages, split = row
    return (f"{'dot' if dot else 'fma'} BN={bn} BK={bk} warps={warps} stages={stages} "
            f"split={'heur' if split is None else split}")


class Chain:
    """The weights of LAYERS decoder layers + lm_head and a graph-replayed decode chain over them."""

    def __init__(self, layers: int, device: torch.device):
        torch.manual_seed(0)
        self.device = device

        def weight(name: str) -> torch.Tensor:
            n, k = SHAPES[name]
            return torch.empty(n, k, device=device, dtype=torch.bfloat16).normal_(0.0, k ** -0.5)

        self.layers = [{name: weight(name) for name in ("qkv", "o", "gate_up", "down")} for _ in range(layers)]
        self.lm_head = weight("lm_head")
        self.x0 = torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)
        self.bytes = sum(w.numel() * 2 for layer in self.layers for w in layer.values()) + self.lm_head.numel() * 2
        self.kernels = 4 * layers + 1

    def run(self) -> torch.Tensor:
        x = self.x0  # [1, HIDDEN]
        for layer in self.layers:
            qkv = G.skinny_linear(x, layer["qkv"], pdl=PDL)  # [1, Q_OUT + KV_OUT]
            o = G.skinny_linear(qkv[:, :Q_OUT], layer["o"], pdl=PDL)  # [1, HIDDEN]
            gate_up = G.skinny_linear(o, layer["gate_up"], pdl=PDL)  # [1, 2 * INTER]
            x = G.silu_mul_linear(gate_up, layer["down"], pdl=PDL)  # [1, HIDDEN]
        return G.skinny_linear(x, self.lm_head, pdl=PDL)  # [1, VOCAB]

    def time_ms(self, replays: int, blocks: int) -> float:
        """ms per chain: the least mean over `blocks` runs of `replays` graph replays."""
        self.run()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(blocks):
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / replays)
        del graph
        return best


def set_pdl(on: bool) -> None:
    global PDL
    PDL = on and _dispatch.pdl_supported(torch.device("cuda"))


def check_row(name: str, row: tuple, device: torch.device) -> float:
    """Relative error (norm) of this row's kernel on its shape against the fp32 reference; the gated path for down."""
    n, k = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(n + k)
    w = (torch.randn(n, k, device=device, generator=g) * k ** -0.5).to(torch.bfloat16)
    saved = GC.SHAPE_CONFIGS
    try:
        GC.SHAPE_CONFIGS = ((n, k, *row),)
        if name == "down":
            x = torch.randn(1, 2 * k, device=device, generator=g).to(torch.bfloat16)
            out, ref = G.silu_mul_linear(x, w), G.silu_mul_linear_reference(x, w)
        else:
            x = torch.randn(1, k, device=device, generator=g).to(torch.bfloat16)
            out, ref = G.skinny_linear(x, w), G.skinny_linear_reference(x, w)
    finally:
        GC.SHAPE_CONFIGS = saved
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="directory for gemv_chain.jsonl and gemv_chain_summary.txt")
    parser.add_argument("--model", default="qwen3_4b", help="a conf/model name: its shapes are tuned")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: tune one rank's shard shapes")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers in the chain (default: the model's)")
    parser.add_argument("--rounds", type=int, default=1, help="coordinate-descent rounds (2: others at round-1 best)")
    parser.add_argument("--search-pdl", type=int, default=1, choices=(0, 1), help="PDL during the search")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="shape classes to tune (comma-separated)")
    parser.add_argument("--quick", action="store_true", help="BLOCK_N, BLOCK_K, split and 2 tensor-core rows only")
    args = parser.parse_args(argv)
    set_model(args.model, args.tp)
    args.layers = args.layers or LAYERS
    if not torch.cuda.is_available():
        parser.error("needs CUDA (the chain is timed as a CUDA graph)")
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {list(SHAPES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.out_dir / "gemv_chain.jsonl", "w")
    device = torch.device("cuda")
    GC.SHAPE_CONFIGS = ()
    started = time.perf_counter()
    chain = Chain(args.layers, device)
    print(f"chain: {args.layers} layers + lm_head, {chain.kernels} GEMVs, {chain.bytes / 1e9:.2f} GB of weights, "
          f"{torch.cuda.get_device_name()}", flush=True)
    global DOT_ROWS
    axes = ("block_n", "block_k", "num_warps", "num_stages", "split", "dot", "num_stages")
    if args.quick:
        axes = ("block_n", "block_k", "split", "dot")
        DOT_ROWS = DOT_ROWS[:2]

    def measure(rows: dict[str, tuple], pdl: bool, label: str) -> float:
        set_pdl(pdl)
        GC.SHAPE_CONFIGS = shape_configs(rows)
        try:
            ms = chain.time_ms(args.replays, args.blocks)
        finally:
            GC.SHAPE_CONFIGS = ()
        record = {"label": label, "pdl": pdl, "ms": ms, "gbps": chain.bytes / ms / 1e6,
                  "rows": {name: list(row) for name, row in rows.items()}}
        log.write(json.dumps(record) + "\n")
        log.flush()
        return ms

    pdl = bool(args.search_pdl)
    default_rows = {name: DEFAULT_ROW for name in SHAPES}
    best_rows = dict(default_rows)
    base_ms = measure(default_rows, pdl, "default")
    print(f"default: {base_ms:.3f} ms/chain ({chain.bytes / base_ms / 1e6:.0f} GB/s) PDL={int(pdl)}", flush=True)
    for rnd in range(1, args.rounds + 1):
        held = dict(default_rows) if rnd == 1 else dict(best_rows)
        ref_ms = measure(held, pdl, f"round{rnd}-held")
        new_best = dict(best_rows)
        for name in names:
            rows = dict(held)
            row, row_ms = held[name], ref_ms
            seen = {row}
            for axis in axes:
                for cand in axis_candidates(name, row, axis):
                    if cand in seen:
                        continue
                    seen.add(cand)
                    try:
                        err = check_row(name, cand, device)
                        if not err < 1e-2:
                            raise AssertionError(f"relative error {err:.2e} against the fp32 reference")
                        ms = measure({**rows, name: cand}, pdl, f"round{rnd}-{name}-{axis}")
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip the candidate
                        print(f"  {name:8s} {describe(cand):46s} failed: {type(exc).__name__}: {exc}"[:200], flush=True)
                        log.write(json.dumps({"label": f"round{rnd}-{name}-{axis}", "failed": str(exc)[:300],
                                              "row": list(cand)}) + "\n")
                        continue
                    mark = " *" if ms < row_ms else ""
                    print(f"  {name:8s} {describe(cand):46s} {ms:.3f} ms ({ms - ref_ms:+.3f}){mark}", flush=True)
                    if ms < row_ms:
                        row, row_ms = cand, ms
            new_best[name] = row
            print(f"round {rnd} best {name:8s}: {describe(row)}  {row_ms:.3f} ms vs {ref_ms:.3f} with the held row "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        best_rows = new_best
    summary = [(f"{torch.cuda.get_device_name()}, {args.layers} layers + lm_head, {chain.bytes / 1e9:.2f} GB, "
                f"searched with PDL={int(pdl)}, {args.rounds} round(s)")]
    summary += [f"best {name:8s}: {describe(best_rows[name])}" for name in SHAPES]
    for on in (False, True):
        default_ms = measure(default_rows, on, "final-default")
        tuned_ms = measure(best_rows, on, "final-best")
        summary.append(f"PDL={int(on)}: default {default_ms:.3f} ms ({chain.bytes / default_ms / 1e6:.0f} GB/s), "
                       f"all best {tuned_ms:.3f} ms ({chain.bytes / tuned_ms / 1e6:.0f} GB/s), "
                       f"{(default_ms - tuned_ms) / default_ms * 100:+.1f}%")
    summary.append(f"SHAPE_CONFIGS = {shape_configs(best_rows)!r}")
    summary.append(f"took {time.perf_counter() - started:.0f} s")
    text = "\n".join(summary)
    (args.out_dir / "gemv_chain_summary.txt").write_text(text + "\n")
    print(text, flush=True)
    log.close()


if __name__ == "__main__":
    main()
