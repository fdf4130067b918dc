"""task=report: one table and a few plots from every JSON record below a sweep directory.

    python -m sparsekv -m task=bench policy=full,quest task.context=8192,32768,131072 hydra.sweep.dir=outputs/sw
    python -m sparsekv task=report task.dir=outputs/sw          # or: sparsekv-report outputs/sw

Records are the `<run dir>/<task>.json` files the tasks write (tasks.common.write_record):
{"config": resolved config, "status": "ok" | "failed", ...figures}; a failed multirun job's record holds
"error" and "traceback" instead of figures (sparsekv.__main__). Each record becomes one row; a bench record
with an `hf_baseline` entry (task.baseline=true, sparsekv.tasks.bench.baseline) adds one row per HF system beside it.

Written to task.out_dir (default: the scanned directory):
  report.csv   every row, the columns of ID_COLUMNS (report_records), then every numeric figure (nested dicts
               flattened with dots: floors.h2d_gbps, kv_transfer.decode_per_step.h2d_bytes, ...)
  report.md    a Markdown table of the main figures, failed rows with their error, policy warnings, the plots, notes
  *.png        decode ms/token vs context (with the PCIe floor where recorded), prefill tok/s vs context,
               GPU peak memory vs context (bench records only, when the sweep holds any), quality vs density
               (when records carry a top-level `density` and a quality figure: recall, needle_hit,
               needle_recall, accuracy, as task=quality writes). A plot with no data is skipped with a note in
               report.md. task=ruler records: a "RULER" section (accuracy per policy setting, task and length,
               beside density, prefill s and decode ms/token) and ruler_accuracy_vs_density.png (one line per
               policy through its settings, a panel per length), ruler_accuracy_vs_length.png
               (sparsekv.tasks.report_ruler); the main table shows their per-length means.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Any

from sparsekv.tasks.report_plots import draw_plots
from sparsekv.tasks.report_records import columns_of, is_density_key, is_number, is_quality_key, load_rows
from sparsekv.tasks.report_ruler import ruler_markdown

# Markdown table: (header, column, format)
MD_COLUMNS = [
    ("job", "job", None), ("status", "status", None), ("system", "system", None), ("task", "task", None),
    ("model", "model", None), ("policy", "policy", None), ("offload", "offload", None),
    ("GPU blocks", "num_gpu_blocks", "d"), ("block", "block_size", "d"), ("context", "context", "d"),
    ("batch", "batch", "d"), ("prefill tok/s", "prefill_tok_s", ",.0f"), ("prefill s", "prefill_seconds", ".3f"),
    ("prefill ratio", "prefill_ratio", ".2f"), ("decode ms/token", "decode_ms_per_token", ".2f"),
    ("decode floor ms", "decode_floor_ms", ".2f"), ("PCIe floor ms", "decode_pcie_floor_ms", ".2f"),
    ("decode ratio", "decode_ratio", ".2f"), ("GPU peak GiB", "gpu_peak_gib", ".2f"),
    ("GPU cache GiB", "gpu_cache_gib", ".2f"), ("cache hit rate", "gpu_cache_hit_rate", ".2f"),
]
MD_TRAILING = [("policy args", "policy_args", None)]  # after the quality columns, before the error
ERROR_MD_CHARS = 240


# ---------------------------------------------------------------------------------------------- tables


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns_of(rows), restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return path


def _cell(value: Any, spec: str | None) -> str:
    if value is None or value == "":
        return "-"
    if spec is not None and is_number(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return f"{value:{spec}}" if not (spec == "d" and isinstance(value, float)) else f"{value:g}"
    text = str(value).replace("|", "\\|").replace("\n", " ").replace("\r", " ")
    return text


def markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(MD_COLUMNS)
    quality = [k for k in columns_of(rows) if is_density_key(k) or is_quality_key(k)]
    columns += [(k, k, ".3g") for k in quality] + MD_TRAILING
    shown = [c for c in columns if c[0] in ("job", "status", "system") or any(r.get(c[1]) is not None for r in rows)]
    has_error = any(r.get("error") for r in rows)
    header = [c[0] for c in shown] + (["error"] if has_error else [])
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if c[2] else "---" for c in shown) + ("|---|" if has_error else "|")]
    for row in rows:
        cells = [_cell(row.get(key), spec) for _, key, spec in shown]
        if has_error:
            error = row.get("error") or ""
            error = error if len(error) <= ERROR_MD_CHARS else error[:ERROR_MD_CHARS - 1] + "…"
            cells.append(_cell(error, None) if error else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- report


def build_report(directory: str | Path, out_dir: str | Path | None = None, plots: bool = True) -> dict[str, Any]:
    """Scan `directory` for records, write report.csv, report.md and the PNGs into out_dir (default: directory).
    Returns {"csv": path, "markdown": path, "plots": [paths], "rows": n, "failed": n, "notes": [...]}."""
    directory = Path(directory).expanduser()
    from_csv = directory.is_file() and directory.suffix == ".csv"
    if not (directory.is_dir() or from_csv):
        raise FileNotFoundError(f"task.dir={directory} is neither a directory nor a report.csv; pass a sweep or run "
                                "directory (outputs/multirun/<date>/<time>) or a report's CSV")
    rows, notes = load_rows(directory)
    if not rows:
        raise ValueError(f"task.dir={directory}: no sparsekv records (*.json with a `config` key) below it; "
                         "pass the directory of a run or sweep")
    out = Path(out_dir).expanduser() if out_dir else (directory.parent if from_csv else directory)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(rows, out / "report.csv") if not (from_csv and out / "report.csv" == directory) else directory
    skipped = ([], ["plots skipped (report.plots=false, or --no-plots)"])
    png_paths, plot_notes = draw_plots(rows, out) if plots else skipped
    failed = [r for r in rows if r["status"] != "ok"]
    n_records = len({(r["job"], r["record"]) for r in rows})
    main = [r for r in rows if r.get("subtask") in (None, "all")]  # a ruler record's cells: its own section

    text = [f"# sparsekv report: {directory}", "",
            f"{n_records} records, {len(rows)} rows ({len(failed)} not ok); devices: "
            f"{', '.join(sorted({str(r['device']) for r in rows if r.get('device')})) or '-'}", "",
            markdown_table(main), ""] + ruler_markdown(rows)
    if png_paths:
        text += ["## Plots", ""] + [f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in png_paths] + [""]
    warned = list(dict.fromkeys(f"{r['job']} ({r['name'] or r['policy']}): {r['warnings']}" for r in main
                                if r.get("warnings")))
    if warned:  # the policy selected nothing or everything: such a row's density and timings measure no selection
        text += ["## Warnings", ""] + [f"- {w}" for w in warned] + [""]
    all_notes = plot_notes + notes
    if all_notes:
        text += ["## Notes", ""] + [f"- {n}" for n in all_notes] + [""]
    text += [f"All columns (every numeric figure): {csv_path.name}", ""]
    md_path = out / "report.md"
    md_path.write_text("\n".join(text))
    return {"csv": csv_path, "markdown": md_path, "plots": png_paths, "rows": len(rows), "failed": len(failed),
            "notes": all_notes}


def _print_result(result: dict[str, Any]) -> None:
    print(f"report: {result['rows']} rows ({result['failed']} not ok)")
    print(f"csv: {result['csv']}")
    print(f"markdown: {result['markdown']}")
    for path in result["plots"]:
        print(f"plot: {path}")
    for note in result["notes"]:
        print(f"note: {note}")


def run(cfg) -> dict[str, Any]:
    """task=report (settings: the `task` node, sparsekv.tasks.config.ReportTask)."""
    task = cfg.task
    if not task.dir:
        raise ValueError("task=report needs task.dir=<sweep or run directory>, e.g. "
                         "task.dir=outputs/multirun/2025-01-01/12-00-00")
    result = build_report(task.dir, task.out_dir, bool(task.plots))
    _print_result(result)
    return result


def cli(argv: list[str] | None = None) -> int:
    """sparsekv-report DIR [--out-dir OUT] [--no-plots]"""
    parser = argparse.ArgumentParser(prog="sparsekv-report",
                                     description="CSV, Markdown and PNG plots of the records below a sweep directory")
    parser.add_argument("dir", help="a sweep (outputs/multirun/<date>/<time>), run, or outputs/ directory")
    parser.add_argument("-o", "--out-dir", default=None, help="where to write (default: DIR)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    try:
        result = build_report(args.dir, args.out_dir, not args.no_plots)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    _print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
