"""task=bench end to end on the tiny model (CPU), the floor arithmetic by hand, and the measured ceilings (GPU)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from sparsekv.tasks.bench import floors
from sparsekv.llm import compose_config
from sparsekv.models.spec import spec_from_model_config
from sparsekv.tasks import get_task
from sparsekv.tasks.bench.task import bench_config
from sparsekv.tasks.bench.summary import summarize

RECORD_KEYS = {
    "config", "name", "model", "offload", "policy", "device", "gpu_name", "dtype", "batch_size", "context",
    "prompt_tokens", "generated_tokens", "decode_steps", "build_seconds", "warmup_seconds", "wall_seconds",
    "prefill_seconds", "prefill_tok_s", "decode_ms_per_token", "decode_ms_per_token_mean", "decode_tok_s",
    "decode_tok_s_mean", "weight_bytes", "kv_bytes_per_token", "prefill_flops", "prefill_tflops",
    "prefill_floor_s", "prefill_ratio", "decode_context", "decode_bytes_per_step", "decode_gbps",
    "decode_hbm_floor_ms", "decode_pcie_floor_ms", "decode_floor_ms", "decode_ratio", "host_peak_rss_gib",
    "gpu_peak_gib", "gpu_build_peak_gib", "floors",
}
FLOOR_KEYS = {"device", "gpu_name", "torch_version", "cuda_version", "date", "matmul_dtype", "matmul_tflops",
              "hbm_gbps", "h2d_gbps", "d2h_gbps", "h2d_pageable_gbps", "measure_seconds"}


def qwen3_4b_spec():
    cfg = compose_config(["model=qwen3_4b", "model.load_format=dummy"])
    return cfg, spec_from_model_config(cfg.model)


def run_bench(tmp_path, *overrides):
    cfg = compose_config(["task=bench", f"output_dir={tmp_path}", "task.progress=false", *overrides])
    figures = get_task(cfg.task.name)(cfg)
    record = json.loads((tmp_path / "bench.json").read_text())
    return figures, record


# ------------------------------------------------------------------------------------------ end to end


def test_bench_tiny_cpu_end_to_end(tmp_path, capsys):
    _, record = run_bench(tmp_path, "device=cpu", "task.context=300", "task.decode_steps=4")
    assert RECORD_KEYS <= set(record), RECORD_KEYS - set(record)
    assert record["prompt_tokens"] == 300 and record["context"] == 300
    assert record["decode_steps"] == 4 and record["generated_tokens"] == 5  # first token comes from the prefill
    assert record["model"] == "tiny" and record["offload"] == "none" and record["policy"] == "full"
    assert record["device"] == "cpu" and record["gpu_peak_gib"] is None
    assert record["prefill_seconds"] > 0 and record["prefill_tok_s"] > 0
    assert record["decode_ms_per_token"] > 0 and record["decode_ms_per_token_mean"] > 0 and record["decode_tok_s"] > 0
    assert record["host_peak_rss_gib"] > 0
    assert record["decode_context"] == 302
    assert record["graph"]["mode"] == "eager" and record["graph"]["num_graphs"] == 0  # graph=auto without CUDA
    # tiny, float32, tied: the weights are exactly param_count x 4 bytes
    spec = spec_from_model_config(record_cfg_model(record))
    assert record["weight_bytes"] == floors.param_count(spec) * 4
    assert record["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert record["prefill_flops"] == floors.prefill_flops(spec, 300)
    # on CPU: no ceilings, so no floors and no ratios, and nothing crashes
    assert set(record["floors"]) == FLOOR_KEYS
    assert all(record["floors"][k] is None for k in ("matmul_tflops", "hbm_gbps", "h2d_gbps", "d2h_gbps"))
    for key in ("prefill_floor_s", "prefill_ratio", "decode_floor_ms", "decode_ratio", "decode_hbm_floor_ms",
                "decode_pcie_floor_ms"):
        assert record[key] is None, key
    assert record["config"]["task"]["name"] == "bench"
    out = capsys.readouterr().out
    assert "prefill 300 tok" in out and "ms/token" in out and "record:" in out


def record_cfg_model(record):
    from omegaconf import OmegaConf

    return OmegaConf.create(record["config"]["model"])


def test_bench_batch_no_warmup_and_summary(tmp_path, capsys):
    _, record = run_bench(tmp_path / "b2", "device=cpu", "task.context=64", "task.decode_steps=3",
                          "task.batch_size=2", "task.warmup=false", "task.label=tiny-b2")
    assert record["prompt_tokens"] == 128 and record["decode_steps"] == 3 and record["generated_tokens"] == 8
    assert record["warmup_seconds"] is None and record["name"] == "tiny-b2"
    assert record["prefill_flops"] == pytest.approx(2 * floors.prefill_flops(
        spec_from_model_config(record_cfg_model(record)), 64))
    run_bench(tmp_path / "b1", "device=cpu", "task.context=32", "task.decode_steps=2", "task.measure_floors=false")
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "bench.json").write_text(json.dumps({
        "config": {"bench": {"context": 131072, "batch_size": 1, "name": None}}, "status": "failed",
        "error": "OutOfMemoryError: CUDA out of memory"}))
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    (baseline / "bench.json").write_text(json.dumps({
        **{k: v for k, v in record.items() if k != "name"}, "name": "tiny-hf", "hf_baseline": {"systems": {
            "hf": {"status": "ok", "prefill_tok_s": 123.0, "decode_ms_per_token": 4.5},
            "hf-offloaded": {"status": "skipped", "error": "needs CUDA"}}}}))
    capsys.readouterr()
    table = summarize(tmp_path)
    assert "| failed (failed: OutOfMemoryError: CUDA out of memory) | 131072 | 1 |" in table
    assert "| tiny-hf [hf] | 64 | 2 | 123 | - | - | - | 4.50 |" in table
    assert "| tiny-hf [hf-offloaded] (skipped) |" in table
    lines = table.splitlines()
    assert lines[0].startswith("| name | context |") and "decode ms/token" in lines[0]
    assert len([line for line in lines if line.startswith("| tiny")]) == 5
    assert "| tiny-b2 | 64 | 2 |" in table


def test_bench_config_raises_max_model_len_and_fits_kv():
    cfg, spec = qwen3_4b_spec()
    cfg = compose_config(["model=qwen3_4b", "model.load_format=dummy", "task=bench", "task.context=131072",
                          "task.decode_steps=32", "task.batch_size=2"])
    out = bench_config(cfg, spec)
    assert out.scheduler.max_model_len == 131072 + 32 + 1
    assert out.scheduler.max_num_seqs >= 2
    assert out.offload.num_kv_blocks == 2 * (-(-(131072 + 33) // 256) + 1)
    assert cfg.scheduler.max_model_len is None and cfg.offload.num_kv_blocks is None  # the input is untouched
    small = bench_config(compose_config(["task=bench", "task.context=100", "scheduler.max_model_len=2000",
                                         "offload.num_kv_blocks=7"]), spec)
    assert small.scheduler.max_model_len == 2000 and small.offload.num_kv_blocks == 7
    with pytest.raises(ValueError, match="task.context"):
        bench_config(compose_config(["task=bench", "task.context=0"]), spec)


# ------------------------------------------------------------------------------------------ arithmetic


def test_kv_bytes_per_token_by_hand():
    _, spec = qwen3_4b_spec()
    assert floors.kv_bytes_per_token(spec, 2) == 36 * 2 * 8 * 128 * 2 == 147456 == 144 * 1024
    assert floors.kv_bytes_per_token(spec, torch.bfloat16) == 147456
    assert floors.kv_bytes_per_token(spec, torch.float32) == 2 * 147456


def test_prefill_flops_by_hand():
    _, spec = qwen3_4b_spec()
    per_layer = 2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 3 * 2560 * 9728
    assert per_layer == 100925440
    assert floors.linear_params_per_token(spec) == 36 * per_layer
    n = 32768
    linear = 2 * 36 * per_layer * n
    lm_head = 2 * 2560 * 151936  # last token only
    attention = 2 * 2 * 36 * 32 * 128 * n * n / 2
    assert floors.prefill_flops(spec, n) == pytest.approx(linear + lm_head + attention, rel=1e-12)
    assert floors.prefill_flops(spec, n) == pytest.approx(5.5e14, rel=0.02)  # the design's "about 5.5e14"
    assert floors.prefill_flops(spec, n, batch=3) == pytest.approx(3 * (linear + lm_head + attention))
    # chunked: each chunk's diagonal square counted densely
    chunk_extra = 2 * 2 * 36 * 32 * 128 * n * 1024 / 2
    assert floors.prefill_flops(spec, n, chunked=1024) == pytest.approx(linear + lm_head + attention + chunk_extra)
    assert floors.prefill_flops(spec, n, chunked=True) > floors.prefill_flops(spec, n)


def test_decode_bytes_and_params_by_hand():
    _, spec = qwen3_4b_spec()
    params = floors.param_count(spec)
    assert params == 36 * 100925440 + 151936 * 2560 + (36 * 2 * 2560 + 2560) + 36 * 2 * 128
    assert 4.0e9 < params < 4.05e9  # Qwen3-4B: 4.02B parameters, tied embedding
    weights = 2 * params
    kv = 131072 * 147456
    assert kv == 19327352832  # the design's 19.3 GB at 128K
    assert floors.decode_bytes(spec, 131072, 1, 2, weights) == weights + kv
    assert floors.decode_bytes(spec, 1000, 4, 2, 0) == 4 * 1000 * 147456
    # the design's GPU-resident floor at 128K over a 3.0 TB/s copy rate: about 9 ms
    assert floors.decode_bytes(spec, 131072, 1, 2, weights) / 3.0e12 == pytest.approx(9.1e-3, rel=0.05)


def test_budgeted_selection_counts_the_selected_blocks_and_bounds_by_hand():
    _, spec = qwen3_4b_spec()  # 36 layers, 8 KV heads, head_dim 128
    # 122,888 tokens in 1024-token blocks: 120 full blocks and 8 tokens in the unfinished one; 2 blocks kept
    attended, selecting = floors.budgeted_selection(122888, 1024, 36, 2)
    assert (attended, selecting) == (2 * 1024 + 8, 36)
    # the first 4 layers attend all 120 blocks
    attended, selecting = floors.budgeted_selection(122888, 1024, 36, 2, dense_layers=4)
    assert selecting == 32 and attended == pytest.approx(8 + 1024 * (4 * 120 + 32 * 2) / 36)
    # a budget or threshold covering every full block: nothing selects, the whole context is attended
    assert floors.budgeted_selection(122888, 1024, 36, 120) == (122888, 0)
    assert floors.budgeted_selection(122888, 1024, 36, 2, threshold_blocks=120) == (122888, 0)
    assert floors.block_bounds_bytes(spec, 122888, 1024, 2, 36, 2) == 2 * 36 * 120 * 2 * 8 * 128 * 2
    assert floors.block_bounds_bytes(spec, 122888, 1024, 2, 0, 2) == 0
    kv = 122888 * 147456
    density = 2056 / 122888
    assert floors.decode_bytes(spec, 122888, 1, 2, 100, density, 7) == pytest.approx(100 + kv * density + 7)
    assert floors.decode_bytes(spec, 122888, 1, 2, 100, density) < floors.decode_bytes(spec, 122888, 1, 2, 100) / 50


def test_weight_bytes_counts_shared_once_and_can_skip_untied_embedding():
    torch.manual_seed(0)
    tied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
    tied["head"].weight = tied["embed"].weight
    assert floors.weight_bytes(tied) == 40 * 4
    assert floors.weight_bytes(tied, skip_untied_embedding=True) == 40 * 4  # the lm_head reads it whole
    untied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=True)})
    assert floors.weight_bytes(untied) == (40 + 40 + 10) * 4
    assert floors.weight_bytes(untied, skip_untied_embedding=True) == (40 + 10) * 4
    assert floors.weight_bytes(untied.to(torch.bfloat16)) == (40 + 40 + 10) * 2


def test_measured_ceilings_are_none_on_cpu():
    assert floors.matmul_tflops(device="cpu") is None
    assert floors.hbm_gbps(device="cpu") is None
    assert floors.h2d_gbps(device="cpu") is None and floors.d2h_gbps(device="cpu") is None
    measured = floors.measure_floors("cpu")
    assert set(measured) == FLOOR_KEYS
    assert measured["gpu_name"] is None and measured["torch_version"] == torch.__version__
    assert measured["matmul_tflops"] is None and measured["hbm_gbps"] is None


def _fake_ceilings(monkeypatch) -> None:
    """Measured ceilings a CPU run does not have: a slow host link, so that offloaded floors are the PCIe ones."""
    ceilings = {"gpu_name": "fake", "matmul_dtype": "float32", "matmul_tflops": 100.0, "hbm_gbps": 1000.0,
                "h2d_gbps": 0.05, "d2h_gbps": 0.05, "h2d_pageable_gbps": None}
    monkeypatch.setattr(floors, "measure_floors", lambda *a, **k: dict(ceilings))


def test_block_selecting_policy_is_held_to_the_bytes_it_loads(tmp_path, monkeypatch):
    """Offloaded decode's PCIe floor is the KV it actually loaded: quest with a small budget loads a few blocks of
    the context, so its floor is that, not the whole context's KV (the ratio would read below 1)."""
    _fake_ceilings(monkeypatch)
    _, record = run_bench(tmp_path, "device=cpu", "dtype=float32", "offload=cpu", "offload.block_size=16",
                          "offload.prefill_chunk_size=64", "policy=quest", "policy.token_budget=32",
                          "policy.dense_layers=0", "task.context=320", "task.decode_steps=4")
    loaded, context_floor = record["decode_loaded_floor_ms"], record["decode_pcie_floor_ms"]
    assert 0 < loaded < context_floor / 4  # 2 of the 20 blocks per layer
    # the HBM floor reads the same selection: 2 of the 20 full blocks plus the unfinished block's 2 tokens, and
    # every full block's key bounds, besides the weights
    assert record["decode_context"] == 322
    assert record["decode_kv_density"] == pytest.approx((2 * 16 + 2) / 322)
    spec = spec_from_model_config(record_cfg_model(record))
    bounds = spec.num_hidden_layers * 20 * 2 * spec.num_key_value_heads * spec.head_dim * 4
    assert record["decode_metadata_bytes_per_step"] == bounds
    kv = (2 * 16 + 2) * record["kv_bytes_per_token"]
    assert record["decode_bytes_per_step"] == pytest.approx(record["weight_bytes"] + kv + bounds)
    assert record["decode_hbm_floor_ms"] == pytest.approx(record["decode_bytes_per_step"] / 1000e9 * 1e3)
    assert record["decode_floor_ms"] == pytest.approx(max(loaded, record["decode_hbm_floor_ms"]))
    assert record["decode_ratio"] == pytest.approx(record["decode_ms_per_token"] / record["decode_floor_ms"])


def test_batch_curve_measures_every_point_from_one_prefill(tmp_path, monkeypatch):
    """task.batch_curve: one prefill of the widest batch, then decode_steps at each point, widest first; each point
    holds the steps that ran its batch (after the first, which settles the new batch), the KV those loaded and the
    floors of its batch."""
    _fake_ceilings(monkeypatch)
    _, record = run_bench(tmp_path, "device=cpu", "dtype=float32", "offload=cpu", "offload.block_size=16",
                          "offload.prefill_chunk_size=64", "offload.gpu_cache_gib=0", "task.context=320",
                          "task.decode_steps=3", "task.batch_size=4", "task.batch_curve=[1,4,2]")
    points = record["batch_curve"]
    assert [p["batch_size"] for p in points] == [4, 2, 1]
    assert record["prompt_tokens"] == 4 * 320  # one prefill of the widest batch
    assert record["generated_tokens"] == 4 + 3 * (4 + 2 + 1)
    assert [p["decode_steps"] for p in points] == [2, 2, 2]  # each point's steps after its first
    assert [p["decode_context"] for p in points] == [322, 325, 328]  # the median of those
    per_seq = [p["decode_h2d_bytes_per_step"] / p["batch_size"] for p in points]
    assert per_seq[0] > 0 and per_seq == pytest.approx([per_seq[0]] * 3, rel=0.1)  # every sequence's full blocks
    for p in points:
        kv = p["batch_size"] * p["decode_context"] * record["kv_bytes_per_token"]
        assert p["decode_bytes_per_step"] == pytest.approx(record["weight_bytes"] + kv)
        assert p["decode_tok_s"] == pytest.approx(p["batch_size"] * 1e3 / p["decode_ms_per_token"])
        assert p["decode_ratio"] == pytest.approx(p["decode_ms_per_token"] / p["decode_floor_ms"])
    widest = {k: v for k, v in points[0].items() if k != "kv_transfer"}
    assert {k: record[k] for k in widest} == widest  # the record's own figures are the widest point's
    with pytest.raises(ValueError, match=r"needs task.batch_size=4 \(its widest point\)"):
        run_bench(tmp_path / "bad", "device=cpu", "task.context=32", "task.batch_curve=[1,4]")
    with pytest.raises(ValueError, match="repeats a batch size"):
        run_bench(tmp_path / "bad", "device=cpu", "task.context=32", "task.batch_size=2", "task.batch_curve=[2,2]")


# ------------------------------------------------------------------------------------------ GPU host


@pytest.mark.gpu
def test_gpu_measured_ceilings_are_plausible():
    measured = floors.measure_floors("cuda")
    print(json.dumps(measured, indent=2))
    assert measured["gpu_name"]
    for key, low, high in (("matmul_tflops", 10, 5000), ("hbm_gbps", 100, 20000), ("h2d_gbps", 1, 500),
                           ("d2h_gbps", 1, 500), ("h2d_pageable_gbps", 0.5, 500)):
        value = measured[key]
        assert value is not None and math.isfinite(value) and low < value < high, (key, value)


@pytest.mark.gpu
def test_gpu_bench_tiny_reports_floors_and_ratios(tmp_path):
    _, record = run_bench(tmp_path, "device=cuda", "task.context=2048", "task.decode_steps=8")
    assert record["prompt_tokens"] == 2048 and record["decode_steps"] == 8
    assert record["gpu_peak_gib"] > 0 and record["gpu_build_peak_gib"] > 0 and record["gpu_name"]
    for key in ("prefill_floor_s", "decode_hbm_floor_ms", "decode_floor_ms"):
        assert record[key] > 0, key
    assert record["decode_pcie_floor_ms"] is None  # offload=none
    assert record["prefill_ratio"] >= 1 and record["decode_ratio"] >= 1
    graph = record["graph"]  # graph=auto: the whole step captured per batch size, replayed for every step
    assert graph["mode"] == "cudagraph" and graph["capture_seconds"] > 0 and graph["graph_pool_bytes"] > 0
    assert graph["replayed_steps"] >= 8
