"""Sweeps, reports and plots: failed multirun jobs leave failed records, task=report tables and plots every
record of a sweep, the HF transformers baseline times the same model (CPU here; the offloaded cache on CUDA)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsekv.llm import compose_config
from sparsekv.tasks import get_task
from sparsekv.tasks.report import build_report, cli
from sparsekv.tasks.report_plots import format_tokens, log2_ticks, series_labels, use_log_scale
from sparsekv.tasks.report_records import flatten_record, load_rows
from tests.e2e.test_cli import cli_env

CPU = ["device=cpu", "dtype=float32"]


# ------------------------------------------------------------------------------------------ a real sweep


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """4 jobs of the tiny model: block_size 16/32 x max_model_len 8/4096; the max_model_len=8 jobs fail (the
    default prompt has 71 tokens) and must not stop the sweep."""
    root = tmp_path_factory.mktemp("sweep")
    sweep_dir = root / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "sparsekv", "-m", "task=generate", "device=cpu", "sampling.max_tokens=4",
         "offload.block_size=16,32", "scheduler.max_model_len=8,4096", f"hydra.sweep.dir={sweep_dir}"],
        cwd=root, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return sweep_dir


def test_failed_job_is_recorded_and_the_sweep_goes_on(sweep):
    records = {int(p.parent.name): json.loads(p.read_text()) for p in sweep.glob("*/generate.json")}
    assert sorted(records) == [0, 1, 2, 3]
    for job, record in records.items():
        max_model_len = record["config"]["scheduler"]["max_model_len"]
        if max_model_len == 8:
            assert record["status"] == "failed", job
            assert record["error"].startswith("ValueError: prompt has 71 tokens but max_model_len is 8")
            assert "Traceback" in record["traceback"]
            assert "generated_tokens" not in record
        else:
            assert record["status"] == "ok", (job, record.get("error"))
            assert record["generated_tokens"] == 4 and record["decode_ms_per_token"] > 0
        assert record["config"]["task"]["name"] == "generate"


def test_report_task_builds_csv_markdown_and_plots(sweep, tmp_path):
    cfg = compose_config(["task=report", f"task.dir={sweep}", f"task.out_dir={tmp_path / 'out'}"])
    result = get_task(cfg.task.name)(cfg)
    out = tmp_path / "out"
    assert result["csv"] == out / "report.csv" and result["markdown"] == out / "report.md"
    assert result["rows"] == 4 and result["failed"] == 2

    with (out / "report.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4  # one row per job
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    for row in rows:
        assert row["task"] == "generate" and row["model"] == "tiny" and row["policy"] == "full"
        assert row["offload"] == "none" and row["system"] == "sparsekv"
        assert row["block_size"] == ("16" if row["job"] in ("0", "1") else "32")
        if row["job"] in ("0", "2"):
            assert row["status"] == "failed" and "max_model_len is 8" in row["error"]
            assert row["decode_ms_per_token"] == ""
        else:
            assert row["status"] == "ok" and row["error"] == ""
            assert float(row["decode_ms_per_token"]) > 0 and float(row["prefill_tok_s"]) > 0
            assert row["context"] == "71" and row["batch"] == "1"

    md = (out / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 4  # header + one line per job
    assert sum("| failed |" in line and "max_model_len is 8" in line for line in table) == 2
    pngs = {p.name for p in result["plots"]}
    assert {"decode_ms_vs_context.png", "prefill_tok_s_vs_context.png"} <= pngs
    for path in result["plots"]:
        assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
        assert f"]({path.name})" in md
    # no GPU and no quality records: those plots are skipped with a note, not an error
    assert "GPU peak memory vs context: skipped" in md and "quality vs density: skipped" in md
    assert not (out / "gpu_peak_gib_vs_context.png").exists()


def test_report_cli_defaults_to_the_sweep_dir(sweep, tmp_path, capsys):
    assert cli([str(sweep), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert f"csv: {sweep / 'report.csv'}" in printed and f"markdown: {sweep / 'report.md'}" in printed
    assert (sweep / "report.csv").is_file()
    assert cli([str(tmp_path / "missing")]) == 2
    assert "is neither a directory nor a report.csv" in capsys.readouterr().err
    with pytest.raises(ValueError, match="task=report needs task.dir"):
        get_task("report")(compose_config(["task=report"]))


# ------------------------------------------------------------------------------------------ units


def bench_record(**overrides) -> dict:
    record = {
        "config": {"task": {"name": "bench"}, "model": {"name": "qwen3_4b"}, "policy": {"name": "quest"},
                   "offload": {"mode": "cpu", "num_gpu_blocks": 4, "block_size": 1024},
                   "bench": {"context": 32768, "batch_size": 2}, "device": "cuda", "dtype": "bfloat16"},
        "status": "ok", "name": "qwen3_4b cpu quest", "model": "qwen3_4b", "offload": "cpu", "policy": "quest",
        "device": "cuda:0", "dtype": "bfloat16", "batch_size": 2, "context": 32768, "prefill_tok_s": 1234.5,
        "decode_ms_per_token": 12.5, "decode_pcie_floor_ms": 87.8, "warmup_seconds": None, "gpu_peak_gib": 9.1,
        "measure_floors": True, "text": "hello", "token_ids": [1, 2, 3],
        "floors": {"h2d_gbps": 55.0, "gpu_name": "H100"},
        "kv_transfer": {"decode_per_step": {"h2d_bytes": 4096}},
    }
    record.update(overrides)
    return record


def test_flatten_bench_record_with_hf_baseline():
    baseline = {"transformers_version": "5.0", "systems": {
        "hf": {"system": "hf", "placement": "gpu", "status": "ok", "context": 32768, "batch_size": 2,
               "prefill_seconds": 2.0, "decode_ms_per_token": 30.0, "token_ids": [5]},
        "hf-offloaded": {"system": "hf-offloaded", "placement": "offloaded", "status": "failed",
                         "error": "OutOfMemoryError: CUDA out of memory"}}}
    rows = flatten_record(bench_record(hf_baseline=baseline), job="3", record_name="bench.json")
    assert [r["system"] for r in rows] == ["sparsekv", "hf", "hf-offloaded"]
    main, hf, hf_off = rows
    assert {k: main[k] for k in ("job", "record", "status", "error", "task", "model", "policy", "offload",
                                 "num_gpu_blocks", "block_size", "context", "batch")} == {
        "job": "3", "record": "bench.json", "status": "ok", "error": None, "task": "bench", "model": "qwen3_4b",
        "policy": "quest", "offload": "cpu", "num_gpu_blocks": 4, "block_size": 1024, "context": 32768, "batch": 2}
    # every numeric figure, nested ones with dotted names; strings, lists, bools and None left out
    assert main["decode_ms_per_token"] == 12.5 and main["floors.h2d_gbps"] == 55.0
    assert main["kv_transfer.decode_per_step.h2d_bytes"] == 4096
    for absent in ("text", "token_ids", "measure_floors", "warmup_seconds", "floors.gpu_name", "batch_size",
                   "hf_baseline.systems.hf.decode_ms_per_token", "config.bench.context"):
        assert absent not in main, absent
    assert hf["status"] == "ok" and hf["offload"] == "none" and hf["policy"] is None and hf["block_size"] is None
    assert hf["decode_ms_per_token"] == 30.0 and hf["context"] == 32768 and hf["batch"] == 2 and hf["job"] == "3"
    assert hf_off["status"] == "failed" and hf_off["offload"] == "cpu" and "out of memory" in hf_off["error"]
    assert hf_off["context"] == 32768  # from the bench it belongs to


def test_flatten_failed_and_generate_records():
    failed = {"config": bench_record()["config"], "status": "failed", "error": "RuntimeError: boom",
              "traceback": "Traceback ..."}
    (row,) = flatten_record(failed, job="0", record_name="bench.json")
    assert row["status"] == "failed" and row["error"] == "RuntimeError: boom"
    assert row["context"] == 32768 and row["batch"] == 2  # a failed bench keeps its sweep coordinates
    assert "decode_ms_per_token" not in row
    generate = {"config": {"task": {"name": "generate"}, "model": {"name": "tiny"}, "policy": {"name": "full"},
                           "offload": {"mode": "none", "num_gpu_blocks": 4, "block_size": 256}},
                "prompt_tokens": 71, "decode_ms_per_token": 3.0}  # a record from before "status" existed
    (row,) = flatten_record(generate, record_name="generate.json")
    assert row["status"] == "ok" and row["context"] == 71 and row["batch"] == 1
    assert row["num_gpu_blocks"] is None  # only an offload=cpu layout has GPU slots


def test_load_rows_skips_non_records(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "bench.json").write_text(json.dumps(bench_record()))
    (tmp_path / "1" / ".hydra").mkdir()
    (tmp_path / "1" / ".hydra" / "x.json").write_text(json.dumps(bench_record()))
    (tmp_path / "floors_cache.json").write_text(json.dumps({"h2d_gbps": 55}))
    (tmp_path / "broken.json").write_text("{")
    rows, notes = load_rows(tmp_path)
    assert [r["job"] for r in rows] == ["1"]
    assert len(notes) == 1 and "broken.json" in notes[0]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no sparsekv records"):
        build_report(tmp_path / "empty")


def test_log_scale_decision_and_token_ticks():
    assert use_log_scale([8192, 32768, 131072])  # 16x: more than a decade
    assert not use_log_scale([8192, 32768, 65536])  # 8x
    assert not use_log_scale([71])
    assert use_log_scale([0, 5, 1000]) and not use_log_scale([None, 5.0, 40.0])  # zeros, None ignored
    assert [format_tokens(v) for v in (8192, 32768, 131072, 1 << 20, 300, 1536)] == ["8K", "32K", "128K", "1M",
                                                                                     "300", "1536"]
    assert log2_ticks(8192, 131072) == [8192, 16384, 32768, 65536, 131072]
    assert len(log2_ticks(16, 1 << 20, max_ticks=8)) <= 8


def test_series_labels_name_only_what_varies():
    rows = [flatten_record(bench_record(policy=p, config={**bench_record()["config"], "policy": {"name": p}}))[0]
            for p in ("full", "quest")]
    labels = series_labels(rows)
    assert sorted(labels.values()) == ["full", "quest"]
    # two configs of one policy (quest_2k, quest_4k) differ by the settings that differ, and only those
    base = bench_record()["config"]
    rows = [flatten_record(bench_record(config={**base, "policy": {"name": "quest", "token_budget": budget,
                                                                   "dense_layers": 2}}))[0]
            for budget in (2048, 4096)]
    assert rows[0]["policy_args"] == '{"dense_layers":2,"token_budget":2048}'
    assert sorted(series_labels(rows).values()) == ["token_budget=2048", "token_budget=4096"]


def test_plots_from_synthetic_sweep(tmp_path):
    """decode vs context with the PCIe floor, HF rows beside sparsekv's, quality vs density."""
    job = 0
    for policy in ("full", "quest"):
        for context in (8192, 32768, 131072):
            job += 1
            cfg = {**bench_record()["config"], "policy": {"name": policy}}
            record = bench_record(config=cfg, policy=policy, context=context, decode_ms_per_token=context / 1000,
                                  decode_pcie_floor_ms=context / 2000)
            if policy == "full":
                record["hf_baseline"] = {"systems": {"hf": {"placement": "gpu", "status": "ok",
                                                            "decode_ms_per_token": 40.0, "gpu_peak_gib": 20.0}}}
            (tmp_path / str(job)).mkdir()
            (tmp_path / str(job) / "bench.json").write_text(json.dumps(record))
    for density, recall in ((0.1, 0.9), (0.3, 0.97)):
        job += 1
        cfg = {**bench_record()["config"], "task": {"name": "quality"}}
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "quality.json").write_text(json.dumps(
            {"config": cfg, "status": "ok", "context": 32768, "density": density, "recall": recall,
             "needle_hit": recall - 0.1, "summary": {"prefill": {"density": 0.9, "recall": 0.5}}}))
    result = build_report(tmp_path, tmp_path / "report")
    names = {p.name for p in result["plots"]}
    assert names == {"decode_ms_vs_context.png", "prefill_tok_s_vs_context.png", "gpu_peak_gib_vs_context.png",
                     "quality_vs_density.png"}
    rows = list(csv.DictReader((tmp_path / "report" / "report.csv").open()))
    assert len(rows) == 6 + 3 + 2 and sum(r["system"] == "hf" for r in rows) == 3
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| hf |" in md and "Notes" not in md
    assert "needle_hit" in md.splitlines()[4] and "summary.prefill.recall" not in md  # top-level quality only
    assert rows[-1]["summary.prefill.density"] == "0.9"  # ... while the CSV keeps every figure
    # the committed form: the CSV alone rebuilds the same Markdown tables and the same plots
    again = build_report(tmp_path / "report" / "report.csv", tmp_path / "again")
    assert {p.name for p in again["plots"]} == names
    assert md.splitlines()[1:] == (tmp_path / "again" / "report.md").read_text().splitlines()[1:]


# ------------------------------------------------------------------------------------------ failed-job wrapper


def test_failed_record_outside_multirun(tmp_path):
    from sparsekv.__main__ import in_multirun, record_failed_job

    assert not in_multirun()
    cfg = compose_config(CPU + [f"output_dir={tmp_path}", "task=bench"])
    try:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.cuda.OutOfMemoryError as exc:
        path = record_failed_job(cfg, exc)
    record = json.loads(path.read_text())
    assert path == tmp_path / "bench.json"
    assert record["status"] == "failed" and record["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert "Traceback" in record["traceback"] and record["config"]["task"]["name"] == "bench"


# ------------------------------------------------------------------------------------------ HF baseline


def test_hf_baseline_cpu_device_cache(tmp_path):
    from sparsekv.tasks.bench.baseline import run_hf_baseline

    cfg = compose_config(CPU + ["task=bench"])
    prompt = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    figures = run_hf_baseline(cfg, prompt, 3, "gpu")
    assert figures["status"] == "ok" and figures["system"] == "hf" and figures["cache_api"] == "DynamicCache()"
    assert figures["prefill_seconds"] > 0 and figures["prefill_tok_s"] > 0
    assert figures["decode_ms_per_token"] > 0 and figures["decode_steps"] == 3
    assert figures["context"] == 48 and figures["batch_size"] == 1 and len(figures["token_ids"]) == 4
    assert figures["device"] == "cpu" and figures["dtype"] == "float32" and figures["gpu_peak_gib"] is None
    assert figures["model_source"] == "from_config (random weights)"
    # a batch of equal-length prompts
    batch = run_hf_baseline(cfg, [prompt, prompt[::-1]], 2, "gpu")
    assert batch["batch_size"] == 2 and batch["decode_steps"] == 2


def test_hf_baseline_offloaded_cache():
    from sparsekv.tasks.bench.baseline import offloaded_cache_api, run_hf_baseline

    api, _ = offloaded_cache_api()
    assert api in ("DynamicCache(offloading=True)", "OffloadedCache()", "generate(cache_implementation='offloaded')")
    cpu = run_hf_baseline(compose_config(CPU + ["task=bench"]), list(range(5, 37)), 2, "offloaded")
    assert cpu["status"] == "skipped" and "needs CUDA" in cpu["error"] and cpu["cache_api"] == api
    if not torch.cuda.is_available():
        pytest.skip(f"transformers' offloaded cache ({api}) prefetches on CUDA streams; no CUDA device here")
    prompt = [5 + i % 500 for i in range(512)]  # the tiny model's vocabulary has 512 tokens
    figures = run_hf_baseline(compose_config(["device=cuda", "task=bench"]), prompt, 4, "offloaded")
    assert figures["status"] == "ok" and figures["system"] == "hf-offloaded" and figures["cache_api"] == api
    assert figures["prefill_seconds"] > 0 and figures["decode_ms_per_token"] > 0 and figures["gpu_peak_gib"] > 0


def test_hf_baseline_generate_timing_path():
    """The fallback timing through generate() (used when only cache_implementation='offloaded' exists)."""
    from sparsekv.tasks.bench.baseline import build_hf_model, time_generate, time_manual
    from transformers import DynamicCache

    model, _ = build_hf_model(compose_config(CPU))
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    prefill, steps, tokens = time_generate(model, ids, 3, "dynamic")
    assert prefill > 0 and len(steps) == 3 and all(s > 0 for s in steps) and len(tokens) == 4
    _, _, manual_tokens = time_manual(model, ids, 3, DynamicCache())
    assert manual_tokens == tokens  # greedy either way


def test_hf_config_from_spec_matches_dimensions():
    from sparsekv.tasks.bench.baseline import hf_config_from_spec
    from sparsekv.models.spec import spec_from_model_config

    cfg = compose_config(["model=llama3_8b", "model.load_format=dummy"])
    spec = spec_from_model_config(cfg.model)
    hf = hf_config_from_spec(spec, cfg.model)
    assert type(hf).__name__ == "LlamaConfig"
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads, hf.head_dim, hf.vocab_size) == (
        spec.hidden_size, spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim, spec.vocab_size)
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
    assert rope.get("rope_type") == spec.rope_scaling.get("rope_type", spec.rope_scaling.get("type"))


def test_bench_with_baseline_puts_hf_rows_in_the_report(tmp_path):
    cfg = compose_config(CPU + ["task=bench", f"output_dir={tmp_path / 'run'}", "task.progress=false",
                                "task.context=40", "task.decode_steps=2", "task.baseline=true",
                                "task.measure_floors=false", "task.warmup=false"])
    figures = get_task("bench")(cfg)
    systems = figures["hf_baseline"]["systems"]
    assert systems["hf"]["status"] == "ok" and systems["hf"]["context"] == 40
    assert systems["hf-offloaded"]["status"] == "skipped"  # device=cpu: the offloaded cache needs CUDA
    record = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert record["status"] == "ok" and record["hf_baseline"]["transformers_version"]
    result = build_report(tmp_path, plots=False)
    rows = list(csv.DictReader(result["csv"].open()))
    assert [r["system"] for r in rows] == ["sparsekv", "hf", "hf-offloaded"]
    assert float(rows[1]["decode_ms_per_token"]) > 0 and rows[2]["status"] in ("ok", "skipped")
