"""task=report: one table and a few plots from every JSON record below a sweep directory.

    python -m sparsekv -m task=bench policy=full,quest bench.context=8192,32768,131072 hydra.sweep.dir=outputs/sw
    python -m sparsekv task=report report.dir=outputs/sw          # or: sparsekv-report outputs/sw

Records are the `<run dir>/<task>.json` files the tasks write (tasks.common.write_record):
{"config": resolved config, "status": "ok" | "failed", ...figures}; a failed multirun job's record holds
"error" and "traceback" instead of figures (sparsekv.__main__). Each record becomes one row; a bench record
with an `hf_baseline` entry (bench.baseline=true, sparsekv.baseline) adds one row per HF system beside it.

Written to report.out_dir (default: the scanned directory):
  report.csv   every row, the columns of ID_COLUMNS, then every numeric figure (nested dicts flattened with
               dots: floors.h2d_gbps, kv_transfer.decode_per_step.h2d_bytes, ...)
  report.md    a Markdown table of the main figures, failed rows with their error, the plots, notes
  *.png        decode ms/token vs context (with the PCIe floor where recorded), prefill tok/s vs context,
               GPU peak memory vs context (bench records only, when the sweep holds any), quality vs density
               (when records carry a top-level `density` and a quality figure: recall, needle_hit,
               needle_recall, accuracy, as task=quality writes). A plot with no data is skipped with a note in
               report.md.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterable

# identifying columns, in order; every numeric figure follows them in report.csv
ID_COLUMNS = ["job", "record", "status", "error", "system", "task", "name", "model", "policy", "policy_args",
              "offload", "num_gpu_blocks", "block_size", "context", "batch", "device", "dtype"]
# figure keys already shown as identifying columns
_ID_FIGURES = {"context", "batch_size", "status", "error", "name", "model", "policy", "offload", "device", "dtype",
               "system", "placement"}
# keys that draw one series per value in the plots (only those that differ between rows appear in the legend)
SERIES_KEYS = ["system", "task", "model", "policy", "policy_args", "offload", "num_gpu_blocks", "block_size",
               "batch", "dtype", "device"]
SYSTEM_ORDER = {"sparsekv": 0, "hf": 1, "hf-offloaded": 2}
# Markdown table: (header, column, format)
MD_COLUMNS = [
    ("job", "job", None), ("status", "status", None), ("system", "system", None), ("task", "task", None),
    ("model", "model", None), ("policy", "policy", None), ("offload", "offload", None),
    ("GPU blocks", "num_gpu_blocks", "d"), ("block", "block_size", "d"), ("context", "context", "d"),
    ("batch", "batch", "d"), ("prefill tok/s", "prefill_tok_s", ",.0f"), ("prefill s", "prefill_seconds", ".3f"),
    ("prefill ratio", "prefill_ratio", ".2f"), ("decode ms/token", "decode_ms_per_token", ".2f"),
    ("decode floor ms", "decode_floor_ms", ".2f"), ("PCIe floor ms", "decode_pcie_floor_ms", ".2f"),
    ("decode ratio", "decode_ratio", ".2f"), ("GPU peak GiB", "gpu_peak_gib", ".2f"),
]
MD_TRAILING = [("policy args", "policy_args", None)]  # after the quality columns, before the error
DENSITY_KEYS = ("density",)
QUALITY_PATTERN = re.compile(r"(recall|needle|accuracy|passkey)", re.IGNORECASE)
# drawn against density when present (quality.json's top level: the primary phase's means; needle.json: accuracy)
QUALITY_PLOT_KEYS = ("recall", "needle_hit", "needle_recall", "accuracy")
# tasks whose records measure speed; when a sweep holds any, the speed plots show only them
SPEED_TASKS = ("bench",)
ERROR_MD_CHARS = 240


# ---------------------------------------------------------------------------------------------- records


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _dig(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree


def numeric_figures(tree: dict, prefix: str = "", skip: Iterable[str] = ()) -> dict[str, float]:
    """Every int/float leaf of a record (bools, strings, lists and None left out), nested keys joined by dots."""
    out: dict[str, float] = {}
    skip = set(skip)
    for key, value in tree.items():
        if not prefix and key in skip:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(numeric_figures(value, f"{name}."))
        elif _is_number(value):
            out[name] = value
    return out


def _first(*values: Any) -> Any:
    for value in values:
        if value is not None:
            return value
    return None


def _int_or_none(value: Any) -> int | None:
    return int(value) if _is_number(value) else None


def policy_args(policy_cfg: Any) -> str | None:
    """The policy's settings besides its name, as compact sorted JSON (quest_2k vs quest_4k: both "quest")."""
    if not isinstance(policy_cfg, dict):
        return None
    args = {k: v for k, v in policy_cfg.items() if k != "name"}
    return json.dumps(args, sort_keys=True, separators=(",", ":"), default=str) if args else None


def flatten_record(record: dict, job: str = ".", record_name: str = "") -> list[dict[str, Any]]:
    """The report rows of one record: sparsekv's row, then one row per HF baseline system it carries."""
    config = record.get("config") if isinstance(record.get("config"), dict) else {}
    task = _first(_dig(config, "task.name"), Path(record_name).stem or None)
    status = record.get("status") or "ok"
    offload = _first(record.get("offload"), _dig(config, "offload.mode"))
    bench_like = task == "bench"
    context = _first(_int_or_none(record.get("context")),
                     _int_or_none(_dig(config, "bench.context")) if bench_like else None,
                     _int_or_none(record.get("prompt_tokens")) if task == "generate" else None)
    batch = _first(_int_or_none(record.get("batch_size")),
                   _int_or_none(_dig(config, "bench.batch_size")) if bench_like else None,
                   1 if task == "generate" else None)
    row: dict[str, Any] = {
        "job": job, "record": record_name, "status": status, "error": record.get("error"), "system": "sparsekv",
        "task": task, "name": record.get("name") if isinstance(record.get("name"), str) else None,
        "model": _first(record.get("model"), _dig(config, "model.name")),
        "policy": _first(record.get("policy"), _dig(config, "policy.name")),
        "policy_args": policy_args(_dig(config, "policy")),
        "offload": offload,
        "num_gpu_blocks": _int_or_none(_dig(config, "offload.num_gpu_blocks")) if offload == "cpu" else None,
        "block_size": _int_or_none(_dig(config, "offload.block_size")),
        "context": context, "batch": batch,
        "device": _first(record.get("device"), _dig(config, "device")),
        "dtype": _first(record.get("dtype"), _dig(config, "dtype")),
    }
    row.update(numeric_figures(record, skip={"config", "hf_baseline", *_ID_FIGURES}))
    rows = [row]

    baseline = record.get("hf_baseline")
    systems = baseline.get("systems") if isinstance(baseline, dict) else None
    for system, figures in (systems or {}).items():
        if not isinstance(figures, dict):
            continue
        hf = {**{k: row[k] for k in ID_COLUMNS}, "system": system, "status": figures.get("status") or "ok",
              "error": figures.get("error"), "policy": None, "policy_args": None, "num_gpu_blocks": None,
              "block_size": None,
              "offload": "cpu" if figures.get("placement") == "offloaded" else "none",
              "name": f"{row['model']} {system}",
              "context": _first(_int_or_none(figures.get("context")), row["context"]),
              "batch": _first(_int_or_none(figures.get("batch_size")), row["batch"]),
              "device": _first(figures.get("device"), row["device"]),
              "dtype": _first(figures.get("dtype"), row["dtype"])}
        hf.update(numeric_figures(figures, skip=_ID_FIGURES))
        rows.append(hf)
    return rows


def _job_sort_key(job: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in Path(job).parts]


def load_rows(directory: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows of every record below `directory`, notes about files that were skipped)."""
    directory = Path(directory)
    rows, notes = [], []
    for path in sorted(directory.rglob("*.json")):
        if any(part.startswith(".") for part in path.relative_to(directory).parts[:-1]):
            continue  # .hydra/ and other hidden folders
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            notes.append(f"skipped {path}: {err}")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
            continue  # not a sparsekv record
        job = path.parent.relative_to(directory).as_posix()
        rows.extend(flatten_record(record, job, path.name))
    rows.sort(key=lambda r: (_job_sort_key(r["job"]), r["record"], SYSTEM_ORDER.get(r["system"], 9)))
    return rows, notes


def columns_of(rows: list[dict[str, Any]]) -> list[str]:
    extra: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key not in ID_COLUMNS:
                extra.setdefault(key)
    return ID_COLUMNS + list(extra)


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
    if spec is not None and _is_number(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return f"{value:{spec}}" if not (spec == "d" and isinstance(value, float)) else f"{value:g}"
    text = str(value).replace("|", "\\|").replace("\n", " ").replace("\r", " ")
    return text


def markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(MD_COLUMNS)
    quality = [k for k in columns_of(rows) if _is_density_key(k) or _is_quality_key(k)]
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


# ---------------------------------------------------------------------------------------------- plots


def use_log_scale(values: Iterable[float]) -> bool:
    """Log scale when the positive values span more than a decade (max / min > 10)."""
    positive = [float(v) for v in values if _is_number(v) and v > 0 and math.isfinite(v)]
    return len(positive) >= 2 and max(positive) / min(positive) > 10


def format_tokens(value: float) -> str:
    """8192 -> 8K, 131072 -> 128K, 1048576 -> 1M, 300 -> 300."""
    if value <= 0 or not math.isfinite(value):
        return ""
    n = int(round(value))
    if abs(value - n) > 1e-6 * max(1.0, value):
        return f"{value:g}"
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}K"
    if n >= 1 << 20 and n % (1 << 10) == 0:
        return f"{n / (1 << 20):g}M"
    return str(n)


def log2_ticks(lo: float, hi: float, max_ticks: int = 10) -> list[float]:
    """Powers of two covering [lo, hi], thinned to at most max_ticks."""
    first, last = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    exponents = list(range(first, last + 1))
    stride = max(1, math.ceil(len(exponents) / max_ticks))
    return [2.0 ** e for e in exponents[::stride]]


def _series_key(row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in SERIES_KEYS)


def series_labels(rows: list[dict[str, Any]]) -> dict[tuple, str]:
    """A legend label per series naming only what differs between the plotted series."""
    keys = sorted({_series_key(r) for r in rows}, key=lambda k: tuple(str(v) for v in k))
    # a key names a series when it takes more than one value (None, e.g. an HF row's block size, is no value)
    varying = [i for i, name in enumerate(SERIES_KEYS) if len({k[i] for k in keys} - {None}) > 1
               or (name == "system" and len({k[i] for k in keys}) > 1)]
    args_at = SERIES_KEYS.index("policy_args")
    differing = _differing_policy_args(keys) if args_at in varying else {}
    labels = {}
    for key in keys:
        parts = []
        for i in varying:
            value = key[i]
            if value is None:
                continue
            name = SERIES_KEYS[i]
            if name == "policy_args":
                args = json.loads(value)
                parts += [f"{k}={args[k]}" for k in differing.get(key[SERIES_KEYS.index("policy")], ()) if k in args]
            else:
                parts.append(str(value) if name in ("system", "policy", "model", "task") else f"{name}={value}")
        fallback = key[SERIES_KEYS.index("policy")] or key[SERIES_KEYS.index("system")]
        labels[key] = ", ".join(parts) or str(fallback)
    return labels


def _differing_policy_args(keys: list[tuple]) -> dict[str, list[str]]:
    """Per policy name, the settings whose values differ between the series (what tells quest_2k from quest_4k)."""
    policy_at, args_at = SERIES_KEYS.index("policy"), SERIES_KEYS.index("policy_args")
    by_policy: dict[str, list[dict]] = {}
    for key in keys:
        if key[args_at] is not None:
            by_policy.setdefault(key[policy_at], []).append(json.loads(key[args_at]))
    out = {}
    for policy, dicts in by_policy.items():
        names = sorted({k for d in dicts for k in d})
        out[policy] = [k for k in names if len({json.dumps(d.get(k), sort_keys=True) for d in dicts}) > 1]
    return out


def _points(rows: list[dict[str, Any]], x_key: str, y_key: str) -> list[tuple[float, float]]:
    """(x, median y) over the rows, sorted by x."""
    by_x: dict[float, list[float]] = {}
    for r in rows:
        x, y = r.get(x_key), r.get(y_key)
        if _is_number(x) and _is_number(y) and math.isfinite(y):
            by_x.setdefault(float(x), []).append(float(y))
    return [(x, sorted(ys)[len(ys) // 2] if len(ys) % 2 else sum(sorted(ys)[len(ys) // 2 - 1:len(ys) // 2 + 1]) / 2)
            for x, ys in sorted(by_x.items())]


def _new_axes(figsize=(7.5, 4.8)):
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=120)
    return fig, fig.add_subplot(1, 1, 1)


def _set_context_axis(ax, xs: list[float]) -> None:
    ax.set_xlabel("context (tokens)")
    if use_log_scale(xs):
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

        ax.set_xscale("log", base=2)
        ticks = log2_ticks(min(xs), max(xs))
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(min(xs) / 1.25, max(xs) * 1.25)
    else:
        from matplotlib.ticker import FuncFormatter

        distinct = sorted(set(xs))
        if len(distinct) <= 12:
            ax.set_xticks(distinct)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_tokens(v)))


def _set_y_axis(ax, ys: list[float], label: str, allow_log: bool) -> None:
    ax.set_ylabel(label)
    if allow_log and use_log_scale(ys):
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.10g}"))
    elif all(y >= 0 for y in ys):
        ax.set_ylim(bottom=0, top=max(ys) * 1.1 if ys and max(ys) > 0 else None)


def _finish(fig, ax, title: str, path: Path) -> Path:
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.savefig(path, bbox_inches="tight")
    return path


def plot_vs_context(rows: list[dict[str, Any]], y_key: str, y_label: str, title: str, path: Path,
                    floors: list[tuple[str, str, str]] = (), allow_log_y: bool = True) -> Path | None:
    """One line per series (policy / offload layout / system ...); floors: (record key, legend text, style) drawn
    as lines wherever records carry them (identical floor curves of several series drawn once)."""
    rows = [r for r in rows if r.get("status") == "ok"]
    plotted = [r for r in rows if _points([r], "context", y_key)]
    if not plotted:
        return None
    fig, ax = _new_axes()
    labels = series_labels(plotted)
    xs, ys = [], []
    colors = {}
    for key, label in labels.items():
        pts = _points([r for r in plotted if _series_key(r) == key], "context", y_key)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        colors[key] = line.get_color()
        xs += [p[0] for p in pts]
        ys += [p[1] for p in pts]
    for floor_key, floor_text, style in floors:
        curves: dict[tuple, list[tuple]] = {}
        for key in labels:
            pts = _points([r for r in rows if _series_key(r) == key], "context", floor_key)
            if pts:
                curves.setdefault(tuple((x, round(y, 9)) for x, y in pts), []).append(key)
        for pts, keys in curves.items():
            color = colors[keys[0]] if len(keys) == 1 and len(curves) > 1 else "0.35"
            text = floor_text if len(curves) == 1 else f"{floor_text}: {', '.join(labels[k] for k in keys)}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=style, color=color, label=text)
            xs += [p[0] for p in pts]
            ys += [p[1] for p in pts]
    _set_context_axis(ax, xs)
    _set_y_axis(ax, ys, y_label, allow_log_y)
    return _finish(fig, ax, title, path)


def _is_density_key(key: str) -> bool:
    """A top-level density figure (nested ones, like quality.json's summary.<phase>.density, belong to a phase)."""
    return "." not in key and (key in DENSITY_KEYS or key.endswith("_density"))


def _is_quality_key(key: str) -> bool:
    return "." not in key and bool(QUALITY_PATTERN.search(key))


def quality_metrics(columns: list[str]) -> list[str]:
    """The quality figures to plot against density: the preferred ones present (QUALITY_PLOT_KEYS), else every
    top-level recall / needle / accuracy figure."""
    present = [k for k in columns if _is_quality_key(k)]
    preferred = [k for k in QUALITY_PLOT_KEYS if k in present]
    return preferred or present


def plot_quality(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """quality_vs_density.png: one panel per quality figure (recall, needle hits, ...) against the density
    (fraction of the KV attended), one line per series (policy, ...)."""
    rows = [r for r in rows if r.get("status") == "ok"]
    columns = columns_of(rows)
    density_keys = [k for k in columns if _is_density_key(k)]
    if not density_keys:
        return []
    density = density_keys[0]
    panels = [(k, [r for r in rows if _points([r], density, k)]) for k in quality_metrics(columns)]
    panels = [(k, plotted) for k, plotted in panels if plotted]
    if not panels:
        return []
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(4.2 * len(panels) + 2.5, 4.4), dpi=120)
    labels = series_labels([r for _, plotted in panels for r in plotted])
    colors = {key: f"C{i % 10}" for i, key in enumerate(labels)}
    for i, (q_key, plotted) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        xs = []
        for key, label in labels.items():
            pts = _points([r for r in plotted if _series_key(r) == key], density, q_key)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[key],
                        label=label if i == len(panels) - 1 else None)
                xs += [p[0] for p in pts]
        ax.set_xlabel(f"{density} (fraction of the KV attended)")
        if use_log_scale(xs):
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        fraction = all(-1e-6 <= r[q_key] <= 1 + 1e-6 for r in plotted)
        ax.set_ylabel(f"{q_key}" + (" (fraction)" if fraction else ""))
        if fraction:
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{q_key} vs {density}")
        ax.grid(True, which="major", alpha=0.3)
    fig.axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    path = out_dir / "quality_vs_density.png"
    fig.savefig(path, bbox_inches="tight")
    return [path]


def draw_plots(rows: list[dict[str, Any]], out_dir: Path) -> tuple[list[Path], list[str]]:
    """(PNG paths, notes on the plots skipped)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return [], ["plots skipped: matplotlib is not installed (pip install 'sparsekv[plots]')"]
    plots, notes = [], []
    specs = [
        ("decode_ms_vs_context.png", "decode_ms_per_token", "decode latency (ms/token, median step)",
         "decode ms/token vs context", [("decode_pcie_floor_ms", "PCIe floor (KV of context / H2D)", "--"),
                                        ("decode_loaded_floor_ms", "PCIe floor (blocks loaded / H2D)", ":")], True),
        ("prefill_tok_s_vs_context.png", "prefill_tok_s", "prefill throughput (tokens/s)",
         "prefill tok/s vs context", [], True),
        ("gpu_peak_gib_vs_context.png", "gpu_peak_gib", "GPU peak memory (GiB)", "GPU peak memory vs context", [],
         False),
    ]
    speed_rows = [r for r in rows if r.get("task") in SPEED_TASKS] or rows
    for name, key, label, title, floors, log_y in specs:
        path = plot_vs_context(speed_rows, key, label, title, out_dir / name, floors, allow_log_y=log_y)
        if path is None:
            notes.append(f"{title}: skipped, no successful record has both `context` and `{key}`")
        else:
            plots.append(path)
    quality = plot_quality(rows, out_dir)
    if quality:
        plots += quality
    else:
        notes.append("quality vs density: skipped, no successful record has a `density` figure and a quality figure "
                     "(recall / needle hits / accuracy)")
    return plots, notes


# ---------------------------------------------------------------------------------------------- report


def build_report(directory: str | Path, out_dir: str | Path | None = None, plots: bool = True) -> dict[str, Any]:
    """Scan `directory` for records, write report.csv, report.md and the PNGs into out_dir (default: directory).
    Returns {"csv": path, "markdown": path, "plots": [paths], "rows": n, "failed": n, "notes": [...]}."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"report.dir={directory} is not a directory; pass a sweep or run directory "
                                "(outputs/multirun/<date>/<time>)")
    rows, notes = load_rows(directory)
    if not rows:
        raise ValueError(f"report.dir={directory}: no sparsekv records (*.json with a `config` key) below it; "
                         "pass the directory of a run or sweep")
    out = Path(out_dir).expanduser() if out_dir else directory
    out.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(rows, out / "report.csv")
    png_paths, plot_notes = draw_plots(rows, out) if plots else ([], ["plots skipped (report.plots=false, or --no-plots)"])
    failed = [r for r in rows if r["status"] != "ok"]
    n_records = len({(r["job"], r["record"]) for r in rows})

    text = [f"# sparsekv report: {directory}", "",
            f"{n_records} records, {len(rows)} rows ({len(failed)} not ok); devices: "
            f"{', '.join(sorted({str(r['device']) for r in rows if r.get('device')})) or '-'}", "",
            markdown_table(rows), ""]
    if png_paths:
        text += ["## Plots", ""] + [f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in png_paths] + [""]
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
    """task=report (settings: the `report` key)."""
    report = cfg.report
    if not report.dir:
        raise ValueError("task=report needs report.dir=<sweep or run directory>, e.g. "
                         "report.dir=outputs/multirun/2025-01-01/12-00-00")
    result = build_report(report.dir, report.out_dir, bool(report.plots))
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
