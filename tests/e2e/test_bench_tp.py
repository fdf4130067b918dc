"""task=bench with parallel.tensor_parallel_size=2 (gloo on CPU, fake ceilings): the figures of a tensor-parallel
run are per GPU where the ceiling is one GPU's, and the offloaded PCIe floor is the whole KV over the ranks'
summed H2D rates."""
from __future__ import annotations

import json

import pytest

from sparsekv.llm import compose_config
from sparsekv.models.loader import resolve_spec
from sparsekv.tasks import get_task
from sparsekv.tasks.bench import floors

CEILINGS = {"gpu_name": "fake", "matmul_dtype": "float32", "matmul_tflops": 100.0, "hbm_gbps": 1000.0,
            "h2d_gbps": 0.05, "d2h_gbps": 0.05, "h2d_pageable_gbps": None}


def test_tp2_bench_figures_per_gpu_and_aggregate_pcie_floor(tmp_path, monkeypatch, one_thread):
    monkeypatch.setattr(floors, "measure_floors", lambda *a, **k: dict(CEILINGS))
    monkeypatch.setattr(floors, "ranks_h2d_gbps", lambda size, device_type: [0.04, 0.08][:size])
    cfg = compose_config(["task=bench", f"output_dir={tmp_path}", "task.progress=false", "device=cpu",
                          "dtype=float32", "parallel.tensor_parallel_size=2", "offload=cpu", "offload.block_size=16",
                          "offload.prefill_chunk_size=64", "task.context=160", "task.decode_steps=4"])
    get_task(cfg.task.name)(cfg)
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["tensor_parallel_size"] == 2
    assert record["h2d_gbps_per_rank"] == [0.04, 0.08]
    assert record["h2d_gbps_aggregate"] == pytest.approx(0.12)
    whole_kv = record["decode_context"] * floors.kv_bytes_per_token(resolve_spec(cfg.model), 4)  # float32
    assert record["decode_pcie_floor_ms"] == pytest.approx(1e3 * whole_kv / 0.12e9)
    # per GPU: the model's FLOPs over the time and 2 GPUs, so the ratio is one GPU's ceiling over that rate
    assert record["prefill_tflops"] == pytest.approx(record["prefill_flops"] / record["prefill_seconds"] / 1e12 / 2)
    assert record["prefill_ratio"] == pytest.approx(CEILINGS["matmul_tflops"] / record["prefill_tflops"])
    loaded = record.get("decode_h2d_bytes_per_step")
    if loaded is not None:  # the store's counts: rank 0's heads, x 2 ranks, over the summed rate
        assert record["decode_loaded_floor_ms"] == pytest.approx(1e3 * loaded / 0.12e9)


def test_aggregate_h2d_sums_the_ranks_or_scales_one_gpu():
    assert floors.aggregate_h2d_gbps(50.0, [40.0, 45.0], 2) == pytest.approx(85.0)
    assert floors.aggregate_h2d_gbps(50.0, [40.0, None], 2) == pytest.approx(100.0)  # a rank without a figure
    assert floors.aggregate_h2d_gbps(50.0, None, 1) == pytest.approx(50.0)
    assert floors.aggregate_h2d_gbps(None, None, 2) is None


def test_ranks_h2d_is_not_measured_without_cuda():
    assert floors.ranks_h2d_gbps(2, "cpu") is None
