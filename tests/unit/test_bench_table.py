"""tools/bench_table.py on small fake records: the hierarchy, tp and RULER tables, named blocks, several record
paths, and the decode floor of a budgeted block selection recomputed from a record's fields."""
from __future__ import annotations

import importlib.util
import json
import os
import tarfile
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def bt():
    spec = importlib.util.spec_from_file_location("bench_table", TOOLS / "bench_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODEL = {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128}
KV_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # bf16


def quest_record(batch: int = 1, **extra) -> dict:
    """A quest record as task=bench wrote it before it counted the attended KV: the whole context in the floor."""
    context, weights, hbm = 122888, 15_000_000_000, 3000.0
    total = weights + batch * context * KV_PER_TOKEN
    record = {
        "config": {"model": MODEL, "offload": {"block_size": 1024},
                   "policy": {"name": "quest", "token_budget": 2048, "topk_blocks": None, "threshold_blocks": 0,
                              "dense_layers": 0}},
        "status": "ok", "offload": "cpu", "dtype": "bfloat16", "host_dtype": "auto", "batch_size": batch,
        "tensor_parallel_size": 1, "gpu_name": "NVIDIA H100 80GB HBM3", "decode_context": context,
        "weight_bytes": weights, "decode_bytes_per_step": total, "decode_ms_per_token": 7.0,
        "decode_hbm_floor_ms": total / hbm / 1e6, "decode_pcie_floor_ms": 300.0, "decode_loaded_floor_ms": 0.0,
        "decode_h2d_bytes_per_step": 0.0, "floors": {"hbm_gbps": hbm},
        "kv_transfer": {"decode_per_step": {"cache_hit_blocks": 3840.0 * batch, "cache_miss_blocks": 0.0,
                                            "cache_overflow_blocks": 0.0}},
    }
    return {**record, **extra}


def full_record(ms: float, batch: int = 1, tp: int = 1, **extra) -> dict:
    return {"status": "ok", "offload": "cpu", "dtype": "bfloat16", "host_dtype": "auto", "batch_size": batch,
            "tensor_parallel_size": tp, "gpu_name": "NVIDIA H100 80GB HBM3", "decode_ms_per_token": ms,
            "decode_hbm_floor_ms": 10.0, "decode_pcie_floor_ms": 300.0 / tp, "decode_loaded_floor_ms": 300.0 / tp,
            "decode_h2d_bytes_per_step": 16e9, **extra}


def write_run(root: Path, section: str, row: str, record: dict | None, vs: str | None = None, order: int = 0,
              name: str = "bench.json") -> None:
    folder = root / "records" / section / row
    folder.mkdir(parents=True)
    meta = folder / "run.json"
    meta.write_text(json.dumps({"section": section, "row": row, "vs": vs, "command": f"python -m sparsekv {row}",
                                "date": "2026-11-25"}))
    os.utime(meta, (1e9 + order, 1e9 + order))  # the order the script ran them
    if record is not None:
        (folder / name).write_text(json.dumps(record))


def rows_of(text: str) -> dict[str, list[str]]:
    """Table rows by their first cell -> the cells."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| row "):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells
    return rows


def test_quest_hbm_floor_counts_the_selected_blocks_and_bounds(bt):
    record = quest_record()
    # 120 full blocks per layer, 2 selected, plus the unfinished block's 8 tokens; min and max of all 120 blocks
    kv = (2 * 1024 + 8) * KV_PER_TOKEN
    bounds = 32 * 120 * 2 * 8 * 128 * 2
    expected = (15e9 + kv + bounds) / 3000e9 * 1e3
    assert bt._hbm_floor_ms(record) == pytest.approx(expected)
    assert bt._hbm_floor_ms(record) < record["decode_hbm_floor_ms"] / 1.8  # the whole context's was 10.4 ms
    assert bt.decode_floor(record) == (pytest.approx(expected), "HBM")
    assert bt._decode_ratio(record) == pytest.approx(7.0 / expected)
    assert bt._decode_ratio(record) > 1  # the whole context's floor read 0.67


def test_quest_floor_with_dense_layers_and_a_record_that_counts(bt):
    dense = quest_record()
    dense["config"]["policy"]["dense_layers"] = 32  # every layer attends every block: the record's floor stands
    assert bt._hbm_floor_ms(dense) == pytest.approx(dense["decode_hbm_floor_ms"])
    counted = quest_record(decode_kv_density=0.0167, decode_hbm_floor_ms=5.07)
    assert bt._hbm_floor_ms(counted) == 5.07  # task=bench counted it: the record's figure
    full = full_record(300.0)
    assert bt._hbm_floor_ms(full) == 10.0 and bt.decode_floor(full) == (300.0, "PCIe")


def test_hierarchy_table(bt, tmp_path):
    root = tmp_path / "hier"
    write_run(root, "hierarchy", "full-b4", full_record(80.0, batch=4), order=0)
    write_run(root, "hierarchy", "quest-b2", quest_record(batch=2), vs="hierarchy/full-b4", order=1)
    write_run(root, "hierarchy", "quest-b4", None, vs="hierarchy/full-b4", order=2)  # cut by a time limit
    runs = bt.load_runs(root)
    text = bt.render(runs)
    assert "## KV memory hierarchy" in text and "decode_kv_density" in text  # the note says how the floor is made
    rows = rows_of(text)
    assert list(rows) == ["full-b4", "quest-b2", "quest-b4"]
    header = next(line for line in text.splitlines() if line.startswith("| row "))
    col = {name.strip(): i for i, name in enumerate(header.strip("|").split(" | "))}
    quest = rows["quest-b2"]
    assert quest[col["tok/s"]] == f"{2 * 1000 / 7.0:,.1f}"
    assert quest[col["cache hit / miss / overflow per step"]] == "7,680 / 0 / 0"
    assert quest[col["PCIe floor (ratio)"]] == "none loaded"
    assert quest[col["ratio"]].endswith("(HBM)")
    assert quest[col["tok/s against vs, same run"]] == f"{(2000 / 7.0) / (4000 / 80.0):.2f}x (50.0 tok/s)"
    assert quest[col["host KV"]] == "bfloat16"
    assert rows["full-b4"][col["PCIe floor (ratio)"]] == f"300.00 ms ({80 / 300:.2f}x)"
    assert rows["full-b4"][col["loaded/step"]] == "16.00 GB"
    assert rows["quest-b4"][1].startswith("failed: no record")
    skipped = rows_of(bt.render([r for r in runs if r["record"] is not None]))
    assert list(skipped) == ["full-b4", "quest-b2"]


def test_batch_curve_record_gives_one_row_per_point(bt, tmp_path):
    root = tmp_path / "curve"
    full = full_record(80.0, batch=4, batch_curve=[
        {**full_record(80.0, batch=4), "decode_h2d_bytes_per_step": 16e9},
        {**full_record(45.0, batch=2), "decode_h2d_bytes_per_step": 8e9}])
    write_run(root, "hierarchy", "full-curve", full, order=0)
    quest = quest_record(batch=4, batch_curve=[quest_record(batch=4, decode_ms_per_token=9.0),
                                               quest_record(batch=2), quest_record(batch=1, decode_ms_per_token=5.0)])
    write_run(root, "hierarchy", "quest-curve", quest, vs="hierarchy/full-curve", order=1)
    runs = bt.load_runs(root)
    assert [r["row"] for r in runs] == ["full-curve@b4", "full-curve@b2", "quest-curve@b4", "quest-curve@b2",
                                        "quest-curve@b1"]
    # a point is compared with the vs run's point of its batch; b1 has none there, so the vs run stands
    assert [r["vs"] for r in runs[2:]] == ["hierarchy/full-curve@b4", "hierarchy/full-curve@b2",
                                           "hierarchy/full-curve"]
    rows = rows_of(bt.render(runs))
    header = next(line for line in bt.render(runs).splitlines() if line.startswith("| row "))
    col = {name.strip(): i for i, name in enumerate(header.strip("|").split(" | "))}
    assert rows["full-curve@b2"][col["loaded/step"]] == "8.00 GB"
    assert rows["quest-curve@b4"][col["ms/step"]] == "9.00" and rows["quest-curve@b1"][col["batch"]] == "1"
    assert rows["quest-curve@b2"][col["tok/s against vs, same run"]] == (
        f"{(2000 / 7.0) / (2000 / 45.0):.2f}x (44.4 tok/s)")
    assert rows["quest-curve@b2"][col["cache hit / miss / overflow per step"]] == "7,680 / 0 / 0"


def tp_records(root: Path, model: str) -> None:
    per_rank = {"h2d_gbps_per_rank": [54.0, 53.0], "h2d_gbps_aggregate": 107.0}
    write_run(root, "tp", f"{model}-cpu-128k-tp1", full_record(320.0, h2d_gbps_aggregate=55.0), order=0)
    write_run(root, "tp", f"{model}-32k-prefill-tp1",
              full_record(8.0, offload="none", prefill_seconds=1.2, prefill_tflops=580.0), order=1)
    write_run(root, "tp", f"{model}-cpu-128k-tp2", full_record(180.0, tp=2, **per_rank),
              vs=f"tp/{model}-cpu-128k-tp1", order=2)
    write_run(root, "tp", f"{model}-32k-prefill-tp2",
              full_record(5.0, tp=2, offload="none", prefill_seconds=0.75, prefill_tflops=470.0),
              vs=f"tp/{model}-32k-prefill-tp1", order=3)


def test_tp_table_from_two_packed_record_sets_into_a_named_block(bt, tmp_path):
    for model in ("qwen", "llama"):
        tp_records(tmp_path / model, model)
        with tarfile.open(tmp_path / f"{model}.tgz", "w:gz") as archive:
            archive.add(tmp_path / model / "records", arcname="records")
    write_run(tmp_path / "other", "decode", "4k", full_record(3.6, offload="none"))
    doc = tmp_path / "bench.md"
    doc.write_text("# B\n<!-- bench_table:decode:begin -->\nmain\n<!-- bench_table:decode:end -->\n\n## TP\nintro\n"
                   "<!-- bench_table:tp:begin -->\nold\n<!-- bench_table:tp:end -->\nafter\n")
    assert bt.main([str(tmp_path / "qwen.tgz"), str(tmp_path / "llama.tgz"), str(tmp_path / "other" / "records"),
                    "--update", str(doc), "--block", "tp"]) == 0
    text = doc.read_text()
    assert "main\n<!-- bench_table:decode:end -->" in text and text.endswith("\nafter\n")  # the rest stays
    block = text[text.index("<!-- bench_table:tp:begin -->"):text.index("<!-- bench_table:tp:end -->")]
    assert "old" not in block and "## " not in block and "| 4k |" not in block  # its section only, no heading
    rows = rows_of(block)
    assert list(rows) == [f"{m}-{r}" for m in ("qwen", "llama")
                          for r in ("cpu-128k-tp1", "32k-prefill-tp1", "cpu-128k-tp2", "32k-prefill-tp2")]
    header = next(line for line in block.splitlines() if line.startswith("| row "))
    col = {name.strip(): i for i, name in enumerate(header.strip("|").split(" | "))}
    offloaded, prefill = rows["llama-cpu-128k-tp2"], rows["llama-32k-prefill-tp2"]
    assert offloaded[col["H2D per rank, summed"]] == "54.0 + 53.0 = 107.0 GB/s"
    assert offloaded[col["floor per GPU"]] == "150.00 ms (PCIe)"
    assert offloaded[col["decode speed-up vs TP=1"]] == f"{320 / 180:.2f}x (320.00 ms)"
    assert offloaded[col["GPU"]] == "2x H100 80GB HBM3" and rows["llama-cpu-128k-tp1"][col["GPU"]] == "H100 80GB HBM3"
    assert prefill[col["prefill scaling efficiency vs TP=1"]] == f"{1.2 / (2 * 0.75):.2f} (1.200 s)"
    assert prefill[col["H2D per rank, summed"]] == "-"


def test_update_fills_each_sections_block_and_keeps_the_text_around(bt, tmp_path, capsys):
    write_run(tmp_path, "hierarchy", "cache-off", full_record(364.0))
    write_run(tmp_path, "hierarchy", "cut", None, order=1)
    write_run(tmp_path, "decode", "4k", full_record(3.6, offload="none"), order=2)
    doc = tmp_path / "bench.md"
    original = ("## Decode\nintro\n<!-- bench_table:decode:begin -->\nold decode\n<!-- bench_table:decode:end -->\n"
                "analysis\n### A kernel\n| hand | table |\n## Hierarchy\n<!-- bench_table:hierarchy:begin -->\nold\n"
                "<!-- bench_table:hierarchy:end -->\nafter\n")
    doc.write_text(original)
    assert bt.main([str(tmp_path / "records"), "--update", str(doc), "--skip-unrecorded"]) == 0
    text = doc.read_text()
    decode = text[text.index("<!-- bench_table:decode:begin -->"):text.index("<!-- bench_table:decode:end -->")]
    hierarchy = text[text.index("<!-- bench_table:hierarchy:begin -->"):]
    assert list(rows_of(decode)) == ["4k"] and "old decode" not in decode and "## " not in decode
    assert list(rows_of(hierarchy)) == ["cache-off"] and "\nold\n" not in hierarchy  # the unrecorded run left out
    for kept in ("## Decode\nintro\n", "analysis\n### A kernel\n| hand | table |\n## Hierarchy\n", "\nafter\n"):
        assert kept in text  # headings, prose and hand-made tables outside the blocks stay
    doc.write_text(original.replace("decode:begin", "decode:start"))
    with pytest.raises(SystemExit, match="no block for decode: add the markers"):
        bt.main([str(tmp_path / "records"), "--update", str(doc)])
    assert doc.read_text() == original.replace("decode:begin", "decode:start")  # nothing written, not even hierarchy


def test_bad_arguments(bt, tmp_path):
    write_run(tmp_path, "hierarchy", "cache-off", full_record(364.0))
    doc = tmp_path / "bench.md"
    doc.write_text("<!-- bench_table:hierarchy:begin -->\nold\n<!-- bench_table:hierarchy:end -->\n")
    with pytest.raises(SystemExit, match="bench_table:nope:begin"):
        bt.main([str(tmp_path / "records"), "--update", str(doc), "--block", "nope"])
    with pytest.raises(SystemExit, match="--block 'a b'"):
        bt.main([str(tmp_path / "records"), "--block", "a b"])
    with pytest.raises(SystemExit, match="no run of section tp"):
        bt.main([str(tmp_path / "records"), "--block", "tp"])
    with pytest.raises(SystemExit, match="neither a folder nor a .tgz"):
        bt.main([str(tmp_path / "missing")])


def ruler_record(policy: str, accuracy: dict[tuple[str, int], float], density: float | None) -> dict:
    lengths = sorted({n for _, n in accuracy})
    cells = [{"task": task, "length": n, "accuracy": a, "density": density} for (task, n), a in accuracy.items()]
    by_length = [{"task": "all", "length": n, "prefill_seconds": 0.05 * n / 4096, "decode_ms_per_token": 1.5}
                 for n in lengths]
    return {"status": "ok", "policy": policy, "offload": "none", "lengths": lengths, "cells": cells,
            "by_length": by_length, "gpu_name": "NVIDIA H100 80GB HBM3"}


def test_ruler_table_gives_accuracy_per_length_and_the_longest_lengths_figures(bt, tmp_path):
    full = {("niah_single", 4096): 1.0, ("variable_tracking", 4096): 0.5,
            ("niah_single", 32768): 0.9, ("variable_tracking", 32768): 0.3}
    quest = {key: value - 0.1 for key, value in full.items()}
    write_run(tmp_path, "ruler_policies", "full-none", ruler_record("full", full, 1.0), name="ruler.json")
    write_run(tmp_path, "ruler_policies", "quest-none", ruler_record("quest", quest, 0.25), order=1,
              name="ruler.json")
    write_run(tmp_path, "ruler_policies", "streaming-none", ruler_record("streaming_llm", full, None), order=2,
              name="ruler.json")
    text = bt.render(bt.load_runs(tmp_path / "records"))
    assert "## Policies judged on the probe (RULER)" in text
    rows = rows_of(text)
    assert list(rows) == ["full-none", "quest-none", "streaming-none"]
    #      policy, offload, lengths, accuracy %, retrieval % / density / decode / prefill at the longest length
    assert rows["full-none"][1:9] == ["full", "none", "4K / 32K", "75.0 / 60.0", "90.0", "1.000", "1.50 ms/token",
                                      "0.400 s"]
    assert rows["quest-none"][4:7] == ["65.0 / 50.0", "80.0", "0.250"]
    assert rows["streaming-none"][6] == "-" and rows["full-none"][10] == "H100 80GB HBM3"
