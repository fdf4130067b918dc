"""task=report's RULER part, from the rows of task=ruler records (sparsekv.tasks.report_records.ruler_rows, or a
report.csv): a table per (policy setting, length, task) and two plots.

  ruler_accuracy_vs_density.png  one panel per context length: accuracy over the tasks against the policy's density,
                                 one line per policy through its budgets (sweep_lines), sorted by density
  ruler_accuracy_vs_length.png   accuracy over the tasks against the context length, one line per policy setting
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sparsekv.tasks.report_plots import SERIES_KEYS, format_tokens, series_labels, use_log_scale
from sparsekv.tasks.report_records import is_number

ALL = "all"  # the subtask of a length's mean over its tasks
# (header, column, format)
TABLE = [("job", "job", None), ("model", "model", None), ("policy", "policy", None),
         ("policy args", "policy_args", None),
         ("offload", "offload", None), ("task", "subtask", None), ("length", "context", "d"),
         ("accuracy %", "accuracy", "pct"), ("density", "density", ".3f"), ("density from", "density_source", None),
         ("samples", "samples", "d"), ("prefill s", "prefill_seconds", ".3f"),
         ("decode ms/token", "decode_ms_per_token", ".2f")]


def ruler_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The successful rows of ruler cells (per task and the per-length means)."""
    return [r for r in rows if r.get("task") == "ruler" and r.get("status") == "ok" and r.get("subtask")]


def _text(value: Any, spec: str | None) -> str:
    if value is None or value == "":
        return "-"
    if spec == "pct" and is_number(value):
        return f"{100 * value:.1f}"
    if spec is not None and is_number(value) and math.isfinite(value):
        return f"{value:g}" if spec == "d" else f"{value:{spec}}"
    return str(value).replace("|", "\\|")


def _sort_key(row: dict[str, Any], order: dict[str, int]) -> tuple:
    return (*(str(row.get(k)) for k in ("model", "offload", "policy", "policy_args")),
            row.get("context") or 0, row.get("subtask") == ALL, order.get(row.get("subtask"), 0), str(row.get("job")))


def ruler_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The "## RULER" section of report.md ([] without ruler rows): every cell, the per-length means last."""
    rows = ruler_rows(rows)
    if not rows:
        return []
    order = {name: i for i, name in enumerate(dict.fromkeys(r["subtask"] for r in rows))}
    shown = [c for c in TABLE if any(r.get(c[1]) is not None for r in rows)]
    lines = ["## RULER", "", "Accuracy: share of the expected answers found in the output; task `all`: the mean over "
             "the tasks at that length.", "",
             "| " + " | ".join(c[0] for c in shown) + " |",
             "|" + "|".join("---:" if c[2] else "---" for c in shown) + "|"]
    for row in sorted(rows, key=lambda r: _sort_key(r, order)):
        lines.append("| " + " | ".join(_text(row.get(key), spec) for _, key, spec in shown) + " |")
    return lines + [""]


def _line_key(row: dict[str, Any]) -> tuple:
    """The series key (report_plots.SERIES_KEYS) without the policy's settings: one line per policy."""
    return tuple(None if k == "policy_args" else row.get(k) for k in SERIES_KEYS)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _args(row: dict[str, Any]) -> dict[str, Any]:
    return json.loads(row["policy_args"]) if row.get("policy_args") else {}


def _differing_args(rows: list[dict[str, Any]]) -> list[str]:
    """The policy settings whose values differ between these rows (what tells the points of one line apart)."""
    dicts = [_args(r) for r in rows]
    names = sorted({k for d in dicts for k in d})
    return [k for k in names if len({json.dumps(d.get(k), sort_keys=True) for d in dicts}) > 1]


def _moves_with(rows: list[dict[str, Any]], swept: str, key: str) -> bool:
    """Whether `key` has one value for each value of `swept` in these rows."""
    seen: dict[str, str] = {}
    for row in rows:
        args = _args(row)
        value = json.dumps(args.get(key), sort_keys=True)
        if seen.setdefault(json.dumps(args.get(swept), sort_keys=True), value) != value:
            return False
    return True


def sweep_lines(rows: list[dict[str, Any]]) -> list[tuple[str, str | None, list[dict[str, Any]]]]:
    """One policy's rows split into budget sweeps: (what fixes the line, e.g. "dense_layers=2"; the swept setting,
    the differing one with the most values, e.g. token_budget; the line's rows). Each other differing setting gives
    a line per value, so a sweep never zig-zags between, say, Quest with and without dense layers; a setting that
    moves with the swept one (one value per swept value, e.g. MInference's slash_size with vertical_size) stays on
    the line."""
    differing = _differing_args(rows)
    if not differing:
        return [("", None, rows)]
    values = {k: {json.dumps(_args(r).get(k), sort_keys=True) for r in rows} for k in differing}

    def fixed_by(swept: str) -> list[str]:
        return [k for k in differing if k != swept and not _moves_with(rows, swept, k)]

    # the most values; on a tie, the setting that leaves the fewest lines (two budgets at two points each beside a
    # variant at one of them: the budgets, not the variant, are the sweep)
    swept = max(differing, key=lambda k: (len(values[k]), -len(fixed_by(k)), -differing.index(k)))
    fixed = fixed_by(swept)
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        args = _args(row)
        lines.setdefault(", ".join(f"{k}={args.get(k)}" for k in fixed), []).append(row)
    return [(name, swept, group) for name, group in sorted(lines.items())]


def sweep_points(rows: list[dict[str, Any]], swept: str | None) -> list[tuple[float, float, str]]:
    """(density, accuracy, label) per setting of one line, medians over its jobs, sorted by density; the label
    names the swept setting's value."""
    settings: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        if is_number(row.get("density")) and is_number(row.get("accuracy")):
            settings.setdefault(row.get("policy_args"), []).append(row)
    points = []
    for group in settings.values():
        label = f"{swept}={_args(group[0]).get(swept)}" if swept else ""
        points.append((_median([r["density"] for r in group]), _median([r["accuracy"] for r in group]), label))
    return sorted(points)


def plot_accuracy_vs_density(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """One panel per length, one line per policy through its settings (sorted by density)."""
    means = [r for r in ruler_rows(rows) if r["subtask"] == ALL and is_number(r.get("density"))
             and is_number(r.get("accuracy")) and is_number(r.get("context"))]
    if not means:
        return None
    from matplotlib.figure import Figure

    lengths = sorted({r["context"] for r in means})
    columns = min(len(lengths), 3)
    grid_rows = -(-len(lengths) // columns)
    fig = Figure(figsize=(4.6 * columns + 2.8, 4.2 * grid_rows), dpi=120)
    labels = series_labels([{**r, "policy_args": None} for r in means])
    lines = [(f"{label}, {fixed}" if fixed else label, swept, group) for key, label in labels.items()
             for fixed, swept, group in sweep_lines([r for r in means if _line_key(r) == key])]
    styles = [(f"C{i % 10}", "-" if i < 10 else "--") for i in range(len(lines))]
    legend: set[str] = set()
    for i, length in enumerate(lengths):
        ax = fig.add_subplot(grid_rows, columns, i + 1)
        for (label, swept, group), (color, style) in zip(lines, styles):
            points = sweep_points([r for r in group if r["context"] == length], swept)
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color, linestyle=style,
                    label=None if label in legend else label)
            legend.add(label)
            for k, (x, y, text) in enumerate(points):
                if text:  # alternately above and below: neighbouring settings stay legible
                    ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 5 if k % 2 == 0 else -11),
                                fontsize="x-small", color=color)
        ax.set_xlim(0, 1.05)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("density (fraction of the attention computed)")
        ax.set_ylabel("accuracy (mean over tasks)")
        ax.set_title(f"RULER at {format_tokens(length)} tokens")
        ax.grid(True, alpha=0.3)
    fig.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 0.95))
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    return path


def plot_accuracy_vs_length(means: list[dict[str, Any]], path: Path) -> Path | None:
    """One line per policy setting: accuracy over the tasks against the context length."""
    means = [r for r in means if is_number(r.get("accuracy")) and is_number(r.get("context"))]
    if not means:
        return None
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig = Figure(figsize=(7.5, 4.8), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    for key, label in series_labels(means).items():
        by_length: dict[float, list[float]] = {}
        for r in means:
            if tuple(r.get(k) for k in SERIES_KEYS) == key:
                by_length.setdefault(float(r["context"]), []).append(float(r["accuracy"]))
        xs = sorted(by_length)
        ax.plot(xs, [_median(by_length[x]) for x in xs], marker="o", label=label)
    lengths = sorted({float(r["context"]) for r in means})
    if use_log_scale(lengths):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_locator(FixedLocator(lengths))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_tokens(v)))
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy (mean over tasks)")
    ax.set_title("RULER accuracy vs context length")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.savefig(path, bbox_inches="tight")
    return path


def plot_ruler(rows: list[dict[str, Any]], out_dir: Path) -> tuple[list[Path], list[str]]:
    """(PNG paths, notes) of the RULER plots; nothing at all without ruler rows."""
    means = [r for r in ruler_rows(rows) if r["subtask"] == ALL]
    if not means:
        return [], []
    plots, notes = [], []
    path = plot_accuracy_vs_density(rows, out_dir / "ruler_accuracy_vs_density.png")
    if path is None:
        notes.append("RULER accuracy vs density: skipped, no ruler row has a density (the policy records none)")
    else:
        plots.append(path)
    path = plot_accuracy_vs_length(means, out_dir / "ruler_accuracy_vs_length.png")
    if path is not None:
        plots.append(path)
    return plots, notes
