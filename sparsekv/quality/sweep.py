"""Sweeps of policies and hyperparameters over inputs, flat rows, per-phase means and a text table."""
from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence as Seq

from sparsekv.policies.base import SparsePolicy
from sparsekv.quality.metrics import evaluate
from sparsekv.quality.planted import AttentionInputs, planted_inputs

def rows(reports: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per (report, phase): the report's fields without "phases", plus phase and its metrics."""
    flat = []
    for report in reports:
        base = {k: v for k, v in report.items() if k != "phases"}
        for phase, metrics in report["phases"].items():
            flat.append({**base, "phase": phase, **metrics})
    return flat


def sweep(policies: Iterable[SparsePolicy], inputs: Iterable[AttentionInputs], **kwargs) -> list[dict[str, Any]]:
    """evaluate() every policy on every input; flat rows (see rows())."""
    inputs = list(inputs)
    return rows(evaluate(policy, x, **kwargs) for policy in policies for x in inputs)


def sweep_field(policy_cls: type, field_name: str, values: Iterable[Any], inputs: Iterable[AttentionInputs],
                **kwargs) -> list[dict[str, Any]]:
    """One policy class at several values of one hyperparameter (e.g. Quest's token_budget); each row carries it."""
    inputs = list(inputs)
    out = []
    for value in values:
        for row in sweep([policy_cls(**{field_name: value})], inputs, **kwargs):
            out.append({field_name: value, **row})
    return out


def planted_grid(depths: Iterable[float], seeds: Iterable[int], **kwargs) -> list[AttentionInputs]:
    """planted_inputs for one needle at each depth and each seed."""
    return [planted_inputs(needle_depths=[d], seed=s, **kwargs) for s in seeds for d in depths]


SUMMARY_KEYS = ("recall", "oracle_recall", "density", "rel_error", "needle_loaded", "needle_recall", "needle_hit")


def summarize(flat: list[dict[str, Any]], keys: Seq[str] = SUMMARY_KEYS) -> dict[str, dict[str, float | None]]:
    """Mean of each metric per phase over the rows (skipped phases ignored)."""
    out: dict[str, dict[str, float | None]] = {}
    for phase in dict.fromkeys(r["phase"] for r in flat):
        phase_rows = [r for r in flat if r["phase"] == phase and "skipped" not in r]
        if not phase_rows:
            out[phase] = {"skipped": next(r["skipped"] for r in flat if r["phase"] == phase)}
            continue
        out[phase] = {}
        for key in keys:
            values = [r[key] for r in phase_rows if r.get(key) is not None]
            out[phase][key] = float(statistics.fmean(values)) if values else None
    return out


TABLE_COLUMNS = [("inputs", "inputs", None), ("depth", "depths", None), ("seed", "seed", None),
                 ("phase", "phase", None), ("recall", "recall", ".3f"), ("oracle", "oracle_recall", ".3f"),
                 ("density", "density", ".3f"), ("rel_err", "rel_error", ".2e"),
                 ("needle_ld", "needle_loaded", ".2f"), ("needle_rc", "needle_recall", ".3f"),
                 ("needle_hit", "needle_hit", ".2f"), ("ms", "seconds", None)]


def format_table(flat: list[dict[str, Any]], columns=TABLE_COLUMNS) -> str:
    def cell(row, key, spec):
        if "skipped" in row and key not in ("inputs", "depths", "seed", "phase"):
            return "skipped" if key == "recall" else ""
        value = row.get(key)
        if value is None:
            return "-"
        if key == "seconds":
            return f"{1e3 * value:.1f}"
        if isinstance(value, list):
            return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in value)
        return f"{value:{spec}}" if spec else str(value)

    table = [[c[0] for c in columns]] + [[cell(r, key, spec) for _, key, spec in columns] for r in flat]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in table)
