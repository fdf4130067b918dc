"""Plots of task=report: decode ms/token, prefill tok/s and GPU peak memory vs context, quality vs density (the
RULER plots: sparsekv.tasks.report_ruler)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from sparsekv.tasks.report_records import columns_of, is_density_key, is_number, is_quality_key

# keys that draw one series per value in the plots (only those that differ between rows appear in the legend)
SERIES_KEYS = ["system", "task", "model", "policy", "policy_args", "offload", "num_gpu_blocks", "block_size",
               "batch", "dtype", "device"]
# drawn against density when present (quality.json's top level: the primary phase's means; needle.json: accuracy)
QUALITY_PLOT_KEYS = ("recall", "needle_hit", "needle_recall", "accuracy")
# tasks whose records measure speed; when a sweep holds any, the speed plots show only them
SPEED_TASKS = ("bench",)


def use_log_scale(values: Iterable[float]) -> bool:
    """Log scale when the positive values span more than a decade (max / min > 10)."""
    positive = [float(v) for v in values if is_number(v) and v > 0 and math.isfinite(v)]
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
        if is_number(x) and is_number(y) and math.isfinite(y):
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


def quality_metrics(columns: list[str]) -> list[str]:
    """The quality figures to plot against density: the preferred ones present (QUALITY_PLOT_KEYS), else every
    top-level recall / needle / accuracy figure."""
    present = [k for k in columns if is_quality_key(k)]
    preferred = [k for k in QUALITY_PLOT_KEYS if k in present]
    return preferred or present


def plot_quality(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """quality_vs_density.png: one panel per quality figure (recall, needle hits, ...) against the density
    (fraction of the KV attended), one line per series (policy, ...)."""
    rows = [r for r in rows if r.get("status") == "ok"]
    columns = columns_of(rows)
    density_keys = [k for k in columns if is_density_key(k)]
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
    from sparsekv.tasks.report_ruler import plot_ruler

    plots, notes = [], []
    rows_by_task = [r for r in rows if r.get("subtask") in (None, "all")]  # a ruler record: its per-length means
    specs = [
        ("decode_ms_vs_context.png", "decode_ms_per_token", "decode latency (ms/token, median step)",
         "decode ms/token vs context", [("decode_pcie_floor_ms", "PCIe floor (KV of context / H2D)", "--"),
                                        ("decode_loaded_floor_ms", "PCIe floor (blocks loaded / H2D)", ":")], True),
        ("prefill_tok_s_vs_context.png", "prefill_tok_s", "prefill throughput (tokens/s)",
         "prefill tok/s vs context", [], True),
        ("gpu_peak_gib_vs_context.png", "gpu_peak_gib", "GPU peak memory (GiB)", "GPU peak memory vs context", [],
         False),
    ]
    speed_rows = [r for r in rows if r.get("task") in SPEED_TASKS] or rows_by_task
    for name, key, label, title, floors, log_y in specs:
        path = plot_vs_context(speed_rows, key, label, title, out_dir / name, floors, allow_log_y=log_y)
        if path is None:
            notes.append(f"{title}: skipped, no successful record has both `context` and `{key}`")
        else:
            plots.append(path)
    quality = plot_quality([r for r in rows if r.get("task") != "ruler"], out_dir)  # ruler: plot_ruler's own
    if quality:
        plots += quality
    elif not any(r.get("task") == "ruler" for r in rows):
        notes.append("quality vs density: skipped, no successful record has a `density` figure and a quality figure "
                     "(recall / needle hits / accuracy)")
    ruler_plots, ruler_notes = plot_ruler(rows, out_dir)
    return plots + ruler_plots, notes + ruler_notes
