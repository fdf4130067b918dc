"""docs/benchmarks.md's tables from the records tools/gpu_bench.sh writes.

    python3 tools/bench_table.py OUT/records                              # print the tables
    python3 tools/bench_table.py OUT/records --update docs/benchmarks.md  # replace the text between the markers
    python3 tools/bench_table.py OUT/records.tgz ...                      # the packed records work too

Each run directory holds run.json ({"section", "row", "vs", "command", "date"}) and the task's record (bench.json
or quality.json). One table per section, in SECTIONS order; rows in the order the script ran them.
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

BEGIN, END = "<!-- bench_table:begin -->", "<!-- bench_table:end -->"
SECTIONS = {
    "decode": "Decode, GPU-resident, CUDA graphs",
    "offload": "Decode, KV offloaded to host memory (full attention)",
    "quest": "Quest decode at 128K, offloaded",
    "prefill": "Prefill, full attention",
    "sparse_prefill": "Sparse prefill at 128K, GPU-resident, structured dummy weights",
    "quality": "Sparse prefill quality at 32K on planted inputs",
    "memory": "GPU memory against context, offloaded",
    "capacity": "Capacity",
}


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Every run below root: run.json merged with {"record": the task's record or None, "path": its folder}."""
    runs = []
    for meta_path in sorted(root.rglob("run.json"), key=lambda p: p.stat().st_mtime):
        meta = json.loads(meta_path.read_text())
        record = None
        for name in ("bench.json", "quality.json"):
            if (meta_path.parent / name).is_file():
                record = json.loads((meta_path.parent / name).read_text())
        runs.append({**meta, "record": record, "path": meta_path.parent})
    return runs


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


def _decode_floor(record: dict) -> str:
    kind = "PCIe" if record.get("offload") == "cpu" else "HBM"
    return _num(record.get("decode_floor_ms"), ".2f", f" ms ({kind})")


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
    ("ratio", lambda r, _: _num(r["record"].get("decode_ratio"), ".2f")),
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
COLUMNS = {"decode": DECODE, "offload": DECODE, "quest": QUEST, "prefill": PREFILL, "sparse_prefill": SPARSE,
           "quality": QUALITY, "memory": MEMORY, "capacity": CAPACITY}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(section: str, runs: list[dict], by_id: dict[str, dict]) -> list[str]:
    columns = COLUMNS.get(section, DECODE)
    header = ["row"] + [c[0] for c in columns] + ["command", "GPU", "date"]
    lines = [f"## {SECTIONS.get(section, section)}", "", "| " + " | ".join(header) + " |",
             "|---|" + "---:|" * len(columns) + "---|---|---|"]
    for run in runs:
        record = run["record"]
        if record is None or record.get("status", "ok") != "ok":
            error = (record or {}).get("error") or f"no record (see {run['path'].name}/run.log)"
            cells = ["failed: " + str(error)[:80]] + ["-"] * (len(columns) - 1)
            gpu = "-"
        else:
            cells = [fn(run, by_id) for _, fn in columns]
            gpu = _gpu(record)
        row = [run["row"]] + cells + [f"`{run['command']}`", gpu, run.get("date") or "-"]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines + [""]


def render(runs: list[dict]) -> str:
    by_id = {f"{r['section']}/{r['row']}": r for r in runs}
    lines: list[str] = []
    for section in list(SECTIONS) + sorted({r["section"] for r in runs} - set(SECTIONS)):
        mine = [r for r in runs if r["section"] == section]
        if mine:
            lines += table(section, mine, by_id)
    return "\n".join(lines).rstrip() + "\n"


def update(path: Path, tables: str) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block to replace; add the two markers first")
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{tables}{END}", text, count=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, help="OUT/records of tools/gpu_bench.sh, or OUT/records.tgz")
    parser.add_argument("--update", type=Path, default=None, help="a Markdown file with the bench_table markers")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.records
        if root.is_file():
            with tarfile.open(root) as archive:
                archive.extractall(tmp, filter="data")
            root = Path(tmp)
        if not root.is_dir():
            raise SystemExit(f"records={args.records} is neither a folder nor a .tgz of tools/gpu_bench.sh records")
        runs = load_runs(root)
        if not runs:
            raise SystemExit(f"records={args.records}: no run.json below it; run tools/gpu_bench.sh first")
        tables = render(runs)
    if args.update:
        update(args.update, tables)
    else:
        sys.stdout.write(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
