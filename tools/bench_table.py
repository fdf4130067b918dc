"""docs/benchmarks.md's tables from the records tools/gpu_bench.sh writes.

    python3 tools/bench_table.py OUT/records                              # print the tables
    python3 tools/bench_table.py OUT/records --update docs/benchmarks.md  # each section's block in the file
    python3 tools/bench_table.py OUT/records.tgz ...                      # the packed records work too
    python3 tools/bench_table.py A.tgz B.tgz --update docs/benchmarks.md --block tp   # a named block, one table

Each run directory holds run.json ({"section", "row", "vs", "command", "date"}) and the task's record (bench.json,
quality.json or ruler.json). One table per section, in SECTIONS order; rows in the order the script ran them (each
records path's runs in turn). --update replaces, for each section the records hold, the text between
<!-- bench_table:SECTION:begin --> and <!-- bench_table:SECTION:end --> with that section's table, without its
"## title" (the document's own heading, introduction and analysis stand around the block and stay); a section without
its block in the file stops the update before anything is written. --block NAME replaces that block alone; a block
not named after a section holds every section's table, each under its title.

Decode floors are recomputed from the record's fields: the larger of the HBM floor and the PCIe floor of the bytes
loaded. The HBM floor counts the KV a step attends; for a record that predates that count (no decode_kv_density),
a budgeted block selection's (quest's) share is computed from the record's config (see _hbm_floor_ms).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Callable

QUEST_DEFAULT_TOKEN_BUDGET = 4096  # sparsekv.policies.quest.policy.DEFAULT_TOKEN_BUDGET
SECTIONS = {
    "decode": "Decode, GPU-resident, CUDA graphs",
    "offload": "Decode, KV offloaded to host memory (full attention)",
    "quest": "Quest decode at 128K, offloaded",
    "prefill": "Prefill, full attention",
    "sparse_prefill": "Sparse prefill at 128K, GPU-resident, structured dummy weights",
    "sparse_prefill_scaling": "Sparse prefill from 128K to 1M, offloaded, structured dummy weights",
    "quality": "Sparse prefill quality at 32K on planted inputs",
    "memory": "GPU memory against context, offloaded",
    "capacity": "Capacity",
    "hierarchy": "KV memory hierarchy: GPU block cache, fp8 host tier, batched Quest",
    "tp": "Tensor parallelism",
    "ruler_policies": "Policies judged on the probe (RULER)",
}
NOTES = {
    "hierarchy": "tok/s: batch x 1000 / ms per step. PCIe floor: the KV bytes loaded from the host per decode step "
                 "(the store's counts) over the pinned H2D rate measured in the same run. HBM floor: (weights + the "
                 "KV a step attends + the selection's key min/max) over the measured HBM copy rate; a Quest row "
                 "attends, per layer, its selected blocks and the unfinished block, and reads the min/max keys of "
                 "every full block. Where a record has no `decode_kv_density`, that share is computed from the "
                 "record's config (token budget, block size, dense layers, model dimensions), `decode_context`, "
                 "`weight_bytes` and the measured `floors.hbm_gbps`. ratio: ms per step / the larger floor. "
                 "Cache: GPU block cache hits / misses (loaded from the host) / overflow (read through the ring) "
                 "per decode step, over all layers and sequences.",
    "tp": "Floors per GPU: the HBM floor reads weights/N + KV/N; offloaded, the PCIe floor is the whole KV over the "
          "sum of the ranks' pinned H2D rates measured concurrently (`h2d_gbps_per_rank`); the prefill floor is "
          "the model's FLOPs over N GPUs' measured GEMM rate. Prefill TFLOP/s is per GPU. Against TP=1: decode "
          "speed-up t1 / tN, prefill scaling efficiency t1 / (N x tN).",
    "ruler_policies": "accuracy: the mean over the record's tasks at each length; retrieval: the mean of its niah "
                      "tasks; density: the policy's measured share of the attention (decode for Quest, prefill for "
                      "MInference and XAttention; '-' where the policy records none); decode per token at the "
                      "record's batch size, prefill per prompt; these four at the longest length.",
}


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Every run below root, in the order they ran: run.json merged with {"record": the task's record or None,
    "path": its folder}."""
    runs = []
    for meta_path in sorted(root.rglob("run.json"), key=lambda p: p.stat().st_mtime):
        meta = json.loads(meta_path.read_text())
        record = None
        for name in ("bench.json", "quality.json", "ruler.json"):
            if (meta_path.parent / name).is_file():
                record = json.loads((meta_path.parent / name).read_text())
        runs.append({**meta, "record": record, "path": meta_path.parent})
    return expand_curves(runs)


def expand_curves(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A bench record with a batch curve (task.batch_curve) becomes one row per point, "<row>@b<batch>", each the
    record with the point's figures; a point's vs row is the vs run's point of the same batch where it has one."""
    out = []
    for run in runs:
        points = (run["record"] or {}).get("batch_curve") or []
        if not points:
            out.append(run)
        for point in points:
            record = {**run["record"], **point, "kv_transfer": {**(run["record"].get("kv_transfer") or {}),
                                                               **(point.get("kv_transfer") or {})}}
            out.append({**run, "row": f"{run['row']}@b{point['batch_size']}", "record": record,
                        "curve_point": point["batch_size"]})
    ids = {f"{r['section']}/{r['row']}" for r in out}
    for run in out:
        point_vs = f"{run.get('vs')}@b{run.get('curve_point')}"
        if run.get("vs") and "curve_point" in run and point_vs in ids:
            run["vs"] = point_vs
    return out


def _num(value: Any, spec: str, unit: str = "") -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return f"{value:{spec}}{unit}"


def _gpu(record: dict) -> str:
    name = record.get("gpu_name") or (record.get("floors") or {}).get("gpu_name") or record.get("device") or "-"
    return str(name).replace("NVIDIA ", "")


def _peer(record: dict, key: str, spec: str, unit: str) -> str:
    systems = (record.get("hf_baseline") or {}).get("systems") or {}
    labels = {"hf": "HF GPU cache", "hf-offloaded": "HF offloaded cache"}
    parts = [f"{labels.get(name, name)} {_num(f.get(key), spec, unit)}" for name, f in systems.items()
             if f.get("status") == "ok"]
    return ", ".join(parts) or "-"


def _budget_blocks(policy: dict, block_size: int) -> int | None:
    """Blocks a budgeted selection (quest's fields: token_budget, topk_blocks) keeps per layer; None otherwise."""
    if "dense_layers" not in policy or not ({"token_budget", "topk_blocks"} & set(policy)):
        return None
    if policy.get("token_budget") is not None or policy.get("topk_blocks") is None:
        return max((policy.get("token_budget") or QUEST_DEFAULT_TOKEN_BUDGET) // block_size, 2)
    return max(int(policy["topk_blocks"]), 2)


def _hbm_floor_ms(record: dict) -> float | None:
    """The decode HBM floor: the record's, when it counts the KV a step attends (decode_kv_density); else, for a
    budgeted block selection, (weights + the selected blocks' and the unfinished block's KV + every full block's key
    min/max) / the measured HBM rate, from the record's config and figures (per GPU under tensor parallelism)."""
    floor = record.get("decode_hbm_floor_ms")
    config = record.get("config") or {}
    block = (config.get("offload") or {}).get("block_size")
    budget = _budget_blocks(config.get("policy") or {}, block) if block else None
    if "decode_kv_density" in record or budget is None:
        return floor
    model = config.get("model") or {}
    context, batch = record.get("decode_context"), record.get("batch_size") or 1
    weights, total, hbm = record.get("weight_bytes"), record.get("decode_bytes_per_step"), \
        (record.get("floors") or {}).get("hbm_gbps")
    layers, kv_heads, head_dim = (model.get(k) for k in ("num_hidden_layers", "num_key_value_heads", "head_dim"))
    if not all(isinstance(v, (int, float)) for v in (context, weights, total, hbm, layers, kv_heads, head_dim)):
        return floor
    policy, tp = config["policy"], record.get("tensor_parallel_size") or 1
    full = (context - 1) // block
    selects = full > budget and full > (policy.get("threshold_blocks") or 0)
    selecting = max(0, layers - (policy.get("dense_layers") or 0)) if selects else 0
    attended = context - full * block + block * ((layers - selecting) * full + selecting * budget) / layers
    kv = (total - weights) * attended / context  # decode_bytes_per_step held the whole context's KV
    itemsize = 2 if record.get("dtype") in ("bfloat16", "float16") else 4
    bounds = batch * selecting * full * 2 * (kv_heads // tp) * head_dim * itemsize
    return (weights + kv + bounds) / (hbm * 1e9) * 1e3


def _pcie_floor_ms(record: dict) -> float | None:
    """Offloaded: the bytes the store loaded per step over the H2D rate (the whole context's without counts)."""
    loaded = record.get("decode_loaded_floor_ms")
    return loaded if loaded is not None else record.get("decode_pcie_floor_ms")


def decode_floor(record: dict) -> tuple[float | None, str]:
    """(ms, "HBM" or "PCIe"): the larger, binding decode floor."""
    floors = [(f, kind) for f, kind in ((_hbm_floor_ms(record), "HBM"), (_pcie_floor_ms(record), "PCIe")) if f]
    return max(floors) if floors else (None, "-")


def _decode_ratio(record: dict) -> float | None:
    floor, ms = decode_floor(record)[0], record.get("decode_ms_per_token")
    return ms / floor if floor and ms else None


def _decode_floor(record: dict) -> str:
    floor, kind = decode_floor(record)
    return _num(floor, ".2f", f" ms ({kind})")


def _speedup(run: dict, by_id: dict[str, dict], key: str, spec: str, unit: str) -> str:
    ref = by_id.get(run.get("vs") or "") or {}
    mine, theirs = run["record"].get(key), (ref.get("record") or {}).get(key)
    if not mine or not theirs:
        return "-"
    return f"{theirs / mine:.2f}x ({_num(theirs, spec, unit)})"


Column = tuple[str, Callable[[dict, dict], str]]
DECODE: list[Column] = [
    ("figure", lambda r, _: _num(r["record"].get("decode_ms_per_token"), ".2f", " ms/step")),
    ("floor", lambda r, _: _decode_floor(r["record"])),
    ("ratio", lambda r, _: _num(_decode_ratio(r["record"]), ".2f")),
    ("peer", lambda r, _: _peer(r["record"], "decode_ms_per_token", ".2f", " ms")),
]
QUEST: list[Column] = DECODE[:3] + [
    ("against full, same run", lambda r, ids: _speedup(r, ids, "decode_ms_per_token", ".2f", " ms")),
]
PREFILL: list[Column] = [
    ("figure", lambda r, _: f"{_num(r['record'].get('prefill_seconds'), '.3f', ' s')} "
                            f"({_num(r['record'].get('prefill_tok_s'), ',.0f', ' tok/s')})"),
    ("floor", lambda r, _: _num(r["record"].get("prefill_floor_s"), ".3f", " s")),
    ("ratio", lambda r, _: _num(r["record"].get("prefill_ratio"), ".2f")),
    ("peer", lambda r, _: _peer(r["record"], "prefill_seconds", ".3f", " s")),
]
SPARSE: list[Column] = PREFILL[:3] + [
    ("against full, same run", lambda r, ids: _speedup(r, ids, "prefill_seconds", ".3f", " s")),
    ("density", lambda r, _: _num(r["record"].get("policy_density"), ".3f")),
]


def _phase(name: str, key: str, spec: str = ".3f") -> Column:
    return (f"{name} {key}", lambda r, _: _num(((r["record"].get("summary") or {}).get(name) or {}).get(key), spec))


QUALITY: list[Column] = [_phase("prefill", k) for k in ("recall", "density", "rel_error", "needle_hit")] + \
                        [_phase("resident", k) for k in ("density", "rel_error", "needle_hit")]
MEMORY: list[Column] = [
    ("context", lambda r, _: _num(r["record"].get("context"), ",d")),
    ("GPU peak", lambda r, _: _num(r["record"].get("gpu_peak_gib"), ".2f", " GiB")),
    ("host RSS", lambda r, _: _num(r["record"].get("host_peak_rss_gib"), ".1f", " GiB")),
]
CAPACITY: list[Column] = MEMORY[:1] + PREFILL[:1] + DECODE[:1]


def _tok_s(record: dict) -> float | None:
    ms = record.get("decode_ms_per_token")
    return (record.get("batch_size") or 1) * 1e3 / ms if ms else None


def _vs_tok_s(run: dict, by_id: dict[str, dict]) -> str:
    """Throughput against the vs row (batches may differ): my tok/s / its tok/s."""
    ref = (by_id.get(run.get("vs") or "") or {}).get("record") or {}
    mine, theirs = _tok_s(run["record"]), _tok_s(ref)
    return f"{mine / theirs:.2f}x ({theirs:,.1f} tok/s)" if mine and theirs else "-"


def _cache(record: dict) -> str:
    per_step = ((record.get("kv_transfer") or {}).get("decode_per_step") or {})
    counts = [per_step.get(f"cache_{k}_blocks") for k in ("hit", "miss", "overflow")]
    return " / ".join(f"{c:,.0f}" for c in counts) if all(isinstance(c, (int, float)) for c in counts) else "off"


def _loaded(record: dict) -> str:
    loaded = record.get("decode_h2d_bytes_per_step")
    return _num(loaded / 1e9 if isinstance(loaded, (int, float)) else None, ".2f", " GB")


def _pcie_loaded(record: dict) -> str:
    floor = record.get("decode_loaded_floor_ms")
    if floor is None:
        return "-"
    if floor == 0:
        return "none loaded"
    ratio = record.get("decode_ms_per_token") / floor if floor and record.get("decode_ms_per_token") else None
    return _num(floor, ".2f", " ms") + (f" ({ratio:.2f}x)" if ratio else "")


def _host_dtype(record: dict) -> str:
    dtype = record.get("host_dtype")
    return str(record.get("dtype") if dtype in (None, "auto") else dtype)


HIERARCHY: list[Column] = [
    ("ms/step", lambda r, _: _num(r["record"].get("decode_ms_per_token"), ".2f")),
    ("batch", lambda r, _: _num(r["record"].get("batch_size"), "d")),
    ("tok/s", lambda r, _: _num(_tok_s(r["record"]), ",.1f")),
    ("loaded/step", lambda r, _: _loaded(r["record"])),
    ("PCIe floor (ratio)", lambda r, _: _pcie_loaded(r["record"])),
    ("HBM floor", lambda r, _: _num(_hbm_floor_ms(r["record"]), ".2f", " ms")),
    ("ratio", lambda r, _: f"{_num(_decode_ratio(r['record']), '.2f')} ({decode_floor(r['record'])[1]})"),
    ("cache hit / miss / overflow per step", lambda r, _: _cache(r["record"])),
    ("host KV", lambda r, _: _host_dtype(r["record"])),
    ("tok/s against vs, same run", _vs_tok_s),
]


def _h2d(record: dict) -> str:
    ranks, total = record.get("h2d_gbps_per_rank"), record.get("h2d_gbps_aggregate")
    if ranks and all(isinstance(g, (int, float)) for g in ranks):
        return " + ".join(f"{g:.1f}" for g in ranks) + f" = {sum(ranks):.1f} GB/s"
    return _num(total, ".1f", " GB/s")


def _vs_tp1(run: dict, by_id: dict[str, dict], key: str) -> str:
    """Against the TP=1 row: decode speed-up t1 / tN, or prefill scaling efficiency t1 / (N x tN)."""
    ref = (by_id.get(run.get("vs") or "") or {}).get("record") or {}
    mine, theirs = run["record"].get(key), ref.get(key)
    if not mine or not theirs:
        return "-"
    if key == "prefill_seconds":
        n = (run["record"].get("tensor_parallel_size") or 1) / (ref.get("tensor_parallel_size") or 1)
        return f"{theirs / (n * mine):.2f} ({theirs:.3f} s)"
    return f"{theirs / mine:.2f}x ({theirs:.2f} ms)"


TP: list[Column] = [
    ("TP", lambda r, _: _num(r["record"].get("tensor_parallel_size"), "d")),
    ("decode", lambda r, _: _num(r["record"].get("decode_ms_per_token"), ".2f", " ms/token")),
    ("floor per GPU", lambda r, _: _decode_floor(r["record"])),
    ("ratio", lambda r, _: _num(_decode_ratio(r["record"]), ".2f")),
    ("H2D per rank, summed", lambda r, _: _h2d(r["record"]) if r["record"].get("offload") == "cpu" else "-"),
    ("decode speed-up vs TP=1", lambda r, ids: _vs_tp1(r, ids, "decode_ms_per_token")),
    ("prefill", lambda r, _: f"{_num(r['record'].get('prefill_seconds'), '.3f', ' s')} "
                             f"({_num(r['record'].get('prefill_tflops'), '.0f', ' TFLOP/s per GPU')})"),
    ("prefill ratio", lambda r, _: _num(r["record"].get("prefill_ratio"), ".2f")),
    ("prefill scaling efficiency vs TP=1", lambda r, ids: _vs_tp1(r, ids, "prefill_seconds")),
]


def _ruler_longest(record: dict) -> int | None:
    return max(record.get("lengths") or [0]) or None


def _ruler_cells(record: dict, length: int | None) -> list[dict]:
    return [c for c in record.get("cells") or [] if c.get("length") == length]


def _mean(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def _ruler_accuracy(record: dict, length: int | None, prefix: str = "") -> float | None:
    """Mean accuracy (%) of the record's tasks starting with prefix at length."""
    return _mean([100 * c["accuracy"] for c in _ruler_cells(record, length) if c["task"].startswith(prefix)])


def _ruler_all(record: dict, key: str, spec: str, unit: str) -> str:
    """A figure of the record's by_length row of every task ("task": "all") at the longest length."""
    longest = _ruler_longest(record)
    row = next((b for b in record.get("by_length") or [] if b.get("task") == "all" and b.get("length") == longest), {})
    return _num(row.get(key), spec, unit)


RULER: list[Column] = [
    ("policy", lambda r, _: str(r["record"].get("policy", "-"))),
    ("offload", lambda r, _: str(r["record"].get("offload", "-"))),
    ("lengths", lambda r, _: " / ".join(f"{n // 1024}K" for n in r["record"].get("lengths") or [])),
    ("accuracy %", lambda r, _: " / ".join(_num(_ruler_accuracy(r["record"], n), ".1f")
                                           for n in r["record"].get("lengths") or [])),
    ("retrieval %, longest", lambda r, _: _num(_ruler_accuracy(r["record"], _ruler_longest(r["record"]), "niah"),
                                               ".1f")),
    ("density, longest", lambda r, _: _num(_mean([c.get("density") for c in _ruler_cells(
        r["record"], _ruler_longest(r["record"]))]), ".3f")),
    ("decode, longest", lambda r, _: _ruler_all(r["record"], "decode_ms_per_token", ".2f", " ms/token")),
    ("prefill, longest", lambda r, _: _ruler_all(r["record"], "prefill_seconds", ".3f", " s")),
]
COLUMNS = {"decode": DECODE, "offload": DECODE, "quest": QUEST, "prefill": PREFILL, "sparse_prefill": SPARSE,
           "sparse_prefill_scaling": SPARSE,
           "quality": QUALITY, "memory": MEMORY, "capacity": CAPACITY, "hierarchy": HIERARCHY, "tp": TP,
           "ruler_policies": RULER}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(section: str, runs: list[dict], by_id: dict[str, dict], heading: bool = True) -> list[str]:
    columns = COLUMNS.get(section, DECODE)
    header = ["row"] + [c[0] for c in columns] + ["command", "GPU", "date"]
    lines = [f"## {SECTIONS.get(section, section)}", ""] if heading else []
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(columns) + "---|---|---|"]
    for run in runs:
        record = run["record"]
        if record is None or record.get("status", "ok") != "ok":
            error = (record or {}).get("error") or f"no record (see {run['path'].name}/run.log)"
            cells = ["failed: " + str(error)[:80]] + ["-"] * (len(columns) - 1)
            gpu = "-"
        else:
            cells = [fn(run, by_id) for _, fn in columns]
            gpus = record.get("tensor_parallel_size") or 1
            gpu = (f"{gpus}x " if gpus > 1 else "") + _gpu(record)
        row = [run["row"]] + cells + [f"`{run['command']}`", gpu, run.get("date") or "-"]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines + ([""] + [NOTES[section]] if section in NOTES else []) + [""]


def render(runs: list[dict], headings: bool = True, only: str | None = None) -> str:
    """The tables of every section the runs hold (or of section `only`), each under its "## title" unless headings
    is False."""
    by_id = {f"{r['section']}/{r['row']}": r for r in runs}
    lines: list[str] = []
    for section in list(SECTIONS) + sorted({r["section"] for r in runs} - set(SECTIONS)):
        mine = [r for r in runs if r["section"] == section and only in (None, section)]
        if mine:
            lines += table(section, mine, by_id, headings)
    return "\n".join(lines).rstrip() + "\n"


def markers(block: str) -> tuple[str, str]:
    """The begin and end markers of block `block`."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", block):
        raise SystemExit(f"--block {block!r}: use letters, digits, '_', '-' or '.'")
    return f"<!-- bench_table:{block}:begin -->", f"<!-- bench_table:{block}:end -->"


def _block_pattern(block: str) -> re.Pattern:
    begin, end = markers(block)
    return re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)


def update(path: Path, tables: dict[str, str]) -> None:
    """Replace the text of each named block with its table; the text around the blocks (headings, prose, tables
    of other sources) stays. Every block must be in the file before anything is written."""
    text = path.read_text()
    missing = [block for block in tables if not _block_pattern(block).search(text)]
    if missing:
        hint = " ".join("<!-- bench_table:%s:begin --> ... <!-- bench_table:%s:end -->" % (b, b) for b in missing)
        raise SystemExit(f"{path} has no block for {', '.join(missing)}: add the markers under the section's heading "
                         f"({hint}), or pass --block for one of the others")
    for block, table_text in tables.items():
        begin, end = markers(block)
        text = _block_pattern(block).sub(lambda _: f"{begin}\n{table_text}{end}", text, count=1)
    path.write_text(text)


def _unpack(path: Path, into: Path) -> Path:
    if path.is_file():
        with tarfile.open(path) as archive:
            archive.extractall(into, filter="data")
        return into
    if not path.is_dir():
        raise SystemExit(f"records={path} is neither a folder nor a .tgz of tools/gpu_bench.sh records")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+",
                        help="OUT/records of tools/gpu_bench.sh, or OUT/records.tgz; several make one set of tables")
    parser.add_argument("--update", type=Path, default=None, help="a Markdown file with the bench_table markers")
    parser.add_argument("--block", default=None,
                        help="replace only the block between <!-- bench_table:BLOCK:begin/end --> (default: the "
                             "block of each section the records hold); a block named after a section holds that "
                             "section's table only, without a heading, any other block every section's table")
    parser.add_argument("--skip-unrecorded", action="store_true",
                        help="leave out runs that wrote no record (e.g. cut by a time limit) instead of listing them")
    args = parser.parse_args(argv)
    if args.block is not None:
        markers(args.block)
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i, path in enumerate(args.records):
            found = load_runs(_unpack(path, Path(tmp) / str(i)))
            if not found:
                raise SystemExit(f"records={path}: no run.json below it; run tools/gpu_bench.sh first")
            runs += found
    if args.skip_unrecorded:
        runs = [r for r in runs if r["record"] is not None]
    section = args.block if args.block in SECTIONS else None  # its block sits under the doc's heading
    if section and not any(r["section"] == section for r in runs):
        raise SystemExit(f"--block {args.block}: the records hold no run of section {args.block}")
    if not args.update:
        sys.stdout.write(render(runs, headings=section is None, only=section))
    elif args.block is not None:
        update(args.update, {args.block: render(runs, headings=section is None, only=section)})
    else:
        sections = dict.fromkeys(r["section"] for r in runs)
        update(args.update, {name: render(runs, headings=False, only=name) for name in sections})
    return 0


if __name__ == "__main__":
    sys.exit(main())
