"""A policy that selects nothing or everything because of its settings or the run's shape says so: a printed
warning, `warnings` in the record, a column and a section in the report."""
from __future__ import annotations

import json

import pytest

from sparsekv.llm import compose_config
from sparsekv.tasks import get_task
from sparsekv.tasks.common import policy_warnings
from sparsekv.tasks.report import build_report


def quest(**settings):
    from sparsekv.plugins import registry

    return registry().policies["quest"](**settings)


@pytest.mark.parametrize("settings, layers, block_size, context, needle", [
    ({"dense_layers": 2, "token_budget": 64}, 2, 32, 1024, "policy.dense_layers=2 covers all 2"),
    ({"dense_layers": 0, "token_budget": 4096}, 4, 32, 1024, "the budget of 128 blocks covers all 32 blocks"),
    ({"dense_layers": 0, "token_budget": 64, "threshold_blocks": 40}, 4, 32, 1024, "policy.threshold_blocks=40"),
    ({"dense_layers": 0, "token_budget": 64}, 4, 2048, 1024, "block size 2048 >= context 1024"),
])
def test_each_degenerate_shape_is_named(settings, layers, block_size, context, needle):
    warnings = policy_warnings(quest(**settings), range(layers), block_size, context)
    assert any(needle in w for w in warnings), warnings


def test_a_selecting_run_and_the_dense_policy_have_no_warnings():
    from sparsekv.plugins import registry

    assert policy_warnings(quest(dense_layers=2, token_budget=64), range(4), 32, 1024) == []
    assert policy_warnings(registry().policies["full"](), range(1), 4096, 16) == []


QUALITY_SMALL = ["task=quality", "device=cpu", "task.context=256", "offload.block_size=32", "task.num_heads=2",
                 "task.head_dim=16", "task.depths=[0.5]", "task.phase=decode", "task.probe=false",
                 "policy=quest", "policy.token_budget=64"]


def test_quality_records_and_reports_the_warning(tmp_path, capsys):
    run = tmp_path / "0"
    cfg = compose_config([*QUALITY_SMALL, "task.num_layers=2", f"output_dir={run}"])
    get_task("quality")(cfg)
    captured = capsys.readouterr()
    assert "warning: policy.dense_layers=2 covers all 2 evaluated layers" in captured.out
    assert "quality" in captured.err  # the progress bar
    record = json.loads((run / "quality.json").read_text())
    assert record["density"] == 1.0 and len(record["warnings"]) == 1

    fine = tmp_path / "1"
    get_task("quality")(compose_config([*QUALITY_SMALL, "task.progress=false", f"output_dir={fine}"]))
    captured = capsys.readouterr()
    assert "warning:" not in captured.out and "quality" not in captured.err
    record = json.loads((fine / "quality.json").read_text())
    assert record["warnings"] == [] and record["density"] < 1.0  # the default layers leave quest layers to select

    result = build_report(tmp_path, plots=False)
    csv = (tmp_path / "report.csv").read_text()
    assert "warnings" in csv.splitlines()[0] and "dense_layers=2 covers all 2" in csv
    markdown = result["markdown"].read_text()
    assert "## Warnings" in markdown and markdown.count("dense_layers=2 covers") == 1


def test_bench_with_blocks_larger_than_the_context_warns(tmp_path, capsys):
    cfg = compose_config(["task=bench", f"output_dir={tmp_path}", "task.progress=false", "device=cpu",
                          "dtype=float32", "offload=cpu", "offload.block_size=128", "offload.num_gpu_blocks=2",
                          "offload.prefill_chunk_size=128", "task.context=64", "task.decode_steps=2",
                          "task.warmup=false", "task.measure_floors=false", "policy=quest", "policy.dense_layers=0"])
    get_task("bench")(cfg)
    assert "warning: block size 128 >= context 64" in capsys.readouterr().out
    record = json.loads((tmp_path / "bench.json").read_text())
    assert len(record["warnings"]) == 1 and "no full block" in record["warnings"][0]
