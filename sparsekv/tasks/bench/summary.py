"""Tables of bench records: the one a run prints (print_table) and the Markdown summary of every bench.json
below a folder (summarize: one row per record plus one per HF baseline system, and the ceilings each run measured).

    python -m sparsekv.tasks.bench.task summarize outputs/
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

SUMMARY_COLUMNS = [
    ("name", "name", None), ("context", "context", "d"), ("batch", "batch_size", "d"),
    ("prefill tok/s", "prefill_tok_s", ",.0f"), ("prefill s", "prefill_seconds", ".3f"),
    ("prefill floor s", "prefill_floor_s", ".3f"), ("prefill ratio", "prefill_ratio", ".2f"),
    ("decode ms/token", "decode_ms_per_token", ".2f"), ("decode floor ms", "decode_floor_ms", ".2f"),
    ("decode ratio", "decode_ratio", ".2f"), ("GPU peak GiB", "gpu_peak_gib", ".2f"),
    ("policy density", "policy_density", ".3f"),
]


def _fmt(value: Any, spec: str = ".3g", unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{unit}"


def print_table(f: dict) -> None:
    floors = f.get("floors") or {}
    on = f"{f['device']}" + (f" ({f['gpu_name']})" if f.get("gpu_name") else "")
    density = f" (density {f['policy_density']:.3f})" if f.get("policy_density") is not None else ""
    weights = f" [{f['load_format']}]" if f.get("load_format") else ""
    print(f"bench {f['name']}: model={f['model']}{weights} offload={f['offload']} policy={f['policy']}{density} "
          f"on {on}, {f['dtype']}, batch {f['batch_size']}, context {f['context']}, {f['decode_steps']} decode steps")
    tp = int(f.get("tensor_parallel_size") or 1)
    per_gpu = " per GPU" if tp > 1 else ""
    gpus = f" of {tp} GPUs" if tp > 1 else ""
    rows = [("", "achieved", "floor", "ratio"),
            (f"prefill {f['prompt_tokens']} tok",
             f"{_fmt(f['prefill_seconds'], '.3f', ' s')} = {_fmt(f['prefill_tok_s'], ',.0f', ' tok/s')}"
             f" ({_fmt(f['prefill_tflops'], '.4g', ' TFLOP/s')}{per_gpu})",
             _fmt(f["prefill_floor_s"], ".3f", " s"), _fmt(f["prefill_ratio"], ".2f", "x")),
            ("decode (median step)",
             f"{_fmt(f['decode_ms_per_token'], '.2f', ' ms/token')} = {_fmt(f['decode_tok_s'], ',.1f', ' tok/s')}"
             f" (mean {_fmt(f['decode_ms_per_token_mean'], '.2f', ' ms')})",
             _fmt(f["decode_floor_ms"], ".2f", " ms"), _fmt(f["decode_ratio"], ".2f", "x"))]
    if f.get("decode_hbm_floor_ms") is not None:
        rows.append((f"  HBM floor{per_gpu}", f"{_fmt(f['decode_bytes_per_step'] / 1e9, '.2f', ' GB/step')}",
                     _fmt(f["decode_hbm_floor_ms"], ".2f", " ms"), ""))
    if f.get("decode_pcie_floor_ms") is not None:
        rows.append((f"  PCIe floor (KV of context / H2D{gpus})", "", _fmt(f["decode_pcie_floor_ms"], ".2f", " ms"),
                     ""))
    if f.get("decode_loaded_floor_ms") is not None:
        rows.append((f"  PCIe floor (bytes loaded / H2D{gpus})",
                     _fmt(f["decode_h2d_bytes_per_step"] / 1e9, ".3f", " GB/step"),
                     _fmt(f["decode_loaded_floor_ms"], ".2f", " ms"), _fmt(f["decode_loaded_ratio"], ".2f", "x")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    if floors.get("matmul_tflops") is not None:
        print(f"  ceilings: GEMM {_fmt(floors['matmul_tflops'], '.0f')} TFLOP/s ({floors['matmul_dtype']}), "
              f"HBM {_fmt(floors['hbm_gbps'], ',.0f')} GB/s, H2D {_fmt(floors['h2d_gbps'], '.1f')} GB/s pinned "
              f"({_fmt(floors.get('h2d_pageable_gbps'), '.1f')} pageable), D2H {_fmt(floors['d2h_gbps'], '.1f')} GB/s")
        if tp > 1:
            ranks = ", ".join(_fmt(g, ".1f") for g in f.get("h2d_gbps_per_rank") or [])
            measured = f"measured together per rank [{ranks}] GB/s" if ranks else "one GPU's rate x N"
            print(f"  {tp} GPUs: GEMM ceiling and HBM floor per GPU; aggregate H2D "
                  f"{_fmt(f.get('h2d_gbps_aggregate'), '.1f')} GB/s ({measured})")
    else:
        print("  ceilings: not measured on this device (floors and ratios need CUDA)")
    build = f.get("gpu_build_peak_gib")
    build = f" (while building the engine {build:.2f} GiB)" if build is not None else ""
    print(f"  memory: GPU peak {_fmt(f.get('gpu_peak_gib'), '.2f', ' GiB')}{build}, "
          f"host peak RSS {_fmt(f.get('host_peak_rss_gib'), '.2f', ' GiB')}")


def load_records(directory: str | Path) -> list[dict]:
    records = []
    for path in sorted(Path(directory).rglob("bench.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"skipping {path}: {err}", file=sys.stderr)
            continue
        record["_path"] = str(path)
        records.append(record)
    records.sort(key=lambda r: (str(r.get("name")), r.get("context") or 0, r.get("batch_size") or 0,
                                r["_path"]))
    return records


def _summary_rows(record: dict) -> list[dict]:
    """The record's own row, plus one per HF baseline system (task.baseline=true); failed runs keep a row."""
    config = record.get("config") or {}
    bench = config.get("task") or config.get("bench") or {}  # `bench`: records written before task settings moved
    name = (record.get("name") or bench.get("label") or (config.get("bench") or {}).get("name")
            or Path(record.get("_path", "?")).parent.name)
    row = {**record, "name": name, "context": record.get("context", bench.get("context")),
           "batch_size": record.get("batch_size", bench.get("batch_size"))}
    if record.get("status", "ok") != "ok":
        row["name"] = f"{name} (failed: {str(record.get('error', ''))[:60]})".replace("|", "/")
    rows = [row]
    for system, f in ((record.get("hf_baseline") or {}).get("systems") or {}).items():
        label = f"{name} [{system}]" + ("" if f.get("status") == "ok" else f" ({f.get('status')})")
        rows.append({"name": label, "context": row["context"], "batch_size": row["batch_size"],
                     **{k: f.get(k) for k in ("prefill_tok_s", "prefill_seconds", "decode_ms_per_token",
                                              "gpu_peak_gib")}})
    return rows


def summarize(directory: str | Path) -> str:
    """A Markdown table of every bench.json below `directory` (printed and returned)."""
    records = load_records(directory)
    lines = ["| " + " | ".join(c[0] for c in SUMMARY_COLUMNS) + " |",
             "|" + "|".join("---" if c[2] is None else "---:" for c in SUMMARY_COLUMNS) + "|"]
    for r in records:
        for row in _summary_rows(r):
            cells = [str(row.get(key)) if spec is None else _fmt(row.get(key), spec)
                     for _, key, spec in SUMMARY_COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    devices = sorted({f"{(r.get('floors') or {}).get('gpu_name') or r.get('device')}" for r in records})
    notes = []
    for r in records:
        fl = r.get("floors") or {}
        if fl.get("matmul_tflops") is not None:
            notes.append(f"{r.get('name')} @ {r.get('context')}: GEMM {fl['matmul_tflops']:.0f} TFLOP/s, "
                         f"HBM {fl['hbm_gbps']:,.0f} GB/s, H2D {fl['h2d_gbps']:.1f} GB/s, "
                         f"D2H {fl['d2h_gbps']:.1f} GB/s")
    text = "\n".join(lines)
    text += f"\n\n{len(records)} runs on {', '.join(devices) or 'nothing'}"
    if notes:
        text += "; ceilings measured in each run:\n" + "\n".join(f"- {n}" for n in notes)
    print(text)
    return text
