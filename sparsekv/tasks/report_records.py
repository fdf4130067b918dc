"""Records of task=report: every `<task>.json` below a directory, flattened into rows (one per record, plus one
per HF system of a bench record's hf_baseline; a ruler record gives one per (task, length) cell and one per length
with subtask "all"), and the classification of their columns."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any, Iterable

# identifying columns, in order; every numeric figure follows them in report.csv
ID_COLUMNS = ["job", "record", "status", "error", "warnings", "system", "task", "subtask", "name", "model", "policy",
              "policy_args", "offload", "num_gpu_blocks", "block_size", "context", "batch", "device", "dtype",
              "density_source"]
# figure keys already shown as identifying columns
_ID_FIGURES = {"context", "batch_size", "status", "error", "warnings", "name", "model", "policy", "offload", "device",
               "dtype", "system", "placement", "policy_args"}
# a ruler record's figures that its cells restate per (task, length)
_RULER_SUMMARIES = {"cells", "by_length", "outputs", "accuracy", "density", "samples", "accuracy_by_length",
                    "accuracy_by_task"}
SYSTEM_ORDER = {"sparsekv": 0, "hf": 1, "hf-offloaded": 2}
DENSITY_KEYS = ("density",)
QUALITY_PATTERN = re.compile(r"(recall|needle|accuracy|passkey)", re.IGNORECASE)


def is_number(value: Any) -> bool:
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
        elif is_number(value):
            out[name] = value
    return out


def _first(*values: Any) -> Any:
    for value in values:
        if value is not None:
            return value
    return None


def _int_or_none(value: Any) -> int | None:
    return int(value) if is_number(value) else None


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
                     _int_or_none(_first(_dig(config, "task.context"), _dig(config, "bench.context")))
                     if bench_like else None,
                     _int_or_none(record.get("prompt_tokens")) if task == "generate" else None)
    batch = _first(_int_or_none(record.get("batch_size")),
                   _int_or_none(_first(_dig(config, "task.batch_size"), _dig(config, "bench.batch_size")))
                   if bench_like else None,
                   1 if task == "generate" else None)
    row: dict[str, Any] = {
        "job": job, "record": record_name, "status": status, "error": record.get("error"),
        "warnings": "; ".join(str(w) for w in record.get("warnings") or []) or None, "system": "sparsekv",
        "task": task, "subtask": None, "name": record.get("name") if isinstance(record.get("name"), str) else None,
        "model": _first(record.get("model"), _dig(config, "model.name")),
        "policy": _first(record.get("policy"), _dig(config, "policy.name")),
        "policy_args": policy_args(_dig(config, "policy")),
        "offload": offload,
        "num_gpu_blocks": _int_or_none(_dig(config, "offload.num_gpu_blocks")) if offload == "cpu" else None,
        "block_size": _int_or_none(_dig(config, "offload.block_size")),
        "context": context, "batch": batch,
        "device": _first(record.get("device"), _dig(config, "device")),
        "dtype": _first(record.get("dtype"), _dig(config, "dtype")),
        "density_source": None,
    }
    if task == "ruler" and status == "ok" and isinstance(record.get("cells"), list):
        return ruler_rows(record, row)
    row.update(numeric_figures(record, skip={"config", "hf_baseline", *_ID_FIGURES}))
    rows = [row]

    baseline = record.get("hf_baseline")
    systems = baseline.get("systems") if isinstance(baseline, dict) else None
    for system, figures in (systems or {}).items():
        if not isinstance(figures, dict):
            continue
        hf = {**{k: row[k] for k in ID_COLUMNS}, "system": system, "status": figures.get("status") or "ok",
              "error": figures.get("error"), "warnings": None, "policy": None, "policy_args": None,
              "num_gpu_blocks": None, "block_size": None,
              "offload": "cpu" if figures.get("placement") == "offloaded" else "none",
              "name": f"{row['model']} {system}",
              "context": _first(_int_or_none(figures.get("context")), row["context"]),
              "batch": _first(_int_or_none(figures.get("batch_size")), row["batch"]),
              "device": _first(figures.get("device"), row["device"]),
              "dtype": _first(figures.get("dtype"), row["dtype"])}
        hf.update(numeric_figures(figures, skip=_ID_FIGURES))
        rows.append(hf)
    return rows


def ruler_rows(record: dict, base: dict[str, Any]) -> list[dict[str, Any]]:
    """A task=ruler record's rows: per length, its mean over the tasks (subtask "all"), then one row per task."""
    shared = numeric_figures(record, skip={"config", *_ID_FIGURES, *_RULER_SUMMARIES})
    cells = [c for c in record.get("cells") or [] if isinstance(c, dict)]
    rows = []
    for summary in [s for s in record.get("by_length") or [] if isinstance(s, dict)]:
        length = summary.get("length")
        for cell in [summary] + [c for c in cells if c.get("length") == length]:
            row = {**base, **shared, "subtask": cell.get("task"), "context": _int_or_none(length),
                   "density_source": cell.get("density_source")}
            row.update(numeric_figures(cell, skip={"task", "length"}))
            rows.append(row)
    return rows


def _job_sort_key(job: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in Path(job).parts]


def load_csv_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a report.csv this module wrote (numbers back to numbers, empty cells to None): a committed
    report rebuilds from its CSV alone."""
    def value(text: str) -> Any:
        if text == "":
            return None
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return {"True": True, "False": False}.get(text, text)

    with path.open(newline="") as handle:
        return [{key: value(text) for key, text in row.items()} for row in csv.DictReader(handle)]


def load_rows(directory: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows of every record below `directory`, or of a report.csv when `directory` is one; notes about files that
    were skipped)."""
    directory = Path(directory)
    if directory.is_file() and directory.suffix == ".csv":
        return load_csv_rows(directory), []
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


def is_density_key(key: str) -> bool:
    """A top-level density figure (nested ones, like quality.json's summary.<phase>.density, belong to a phase)."""
    return "." not in key and (key in DENSITY_KEYS or key.endswith("_density"))


def is_quality_key(key: str) -> bool:
    return "." not in key and bool(QUALITY_PATTERN.search(key))
