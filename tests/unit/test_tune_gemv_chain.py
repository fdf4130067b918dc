"""tools/tune_gemv_chain.py's shapes: a model's decode GEMVs, whole or one tensor-parallel rank's shard."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import tune_gemv_chain as tool  # noqa: E402

from sparsekv.kernels import gemv_configs  # noqa: E402


@pytest.fixture(autouse=True)
def restore_default_model():
    yield
    tool.set_model("qwen3_4b", 1)


# (model, tensor-parallel size) pairs whose rank shapes the shipped rows were tuned on (gemv_configs' comments)
TUNED_RUNS = (("qwen3_4b", 1), ("qwen3_8b", 1), ("qwen3_8b", 2), ("qwen3_8b", 4), ("llama3_8b", 1), ("llama3_8b", 2))


def test_shipped_rows_are_shapes_of_the_tuned_runs():
    """Every SHAPE_CONFIGS row is a weight shape one of the tuned runs streams (no row for a shape nothing
    measured), and the default model's four layer GEMVs all have a row."""
    tuned = {(row[0], row[1]) for row in gemv_configs.SHAPE_CONFIGS}
    streamed = set()
    for model, tp in TUNED_RUNS:
        tool.set_model(model, tp)
        streamed |= set(tool.SHAPES.values())
    assert tuned <= streamed, sorted(tuned - streamed)
    tool.set_model("qwen3_4b", 1)
    assert {tool.SHAPES[name] for name in ("qkv", "o", "gate_up", "down")} <= tuned


def test_tensor_parallel_rank_shapes():
    tool.set_model("qwen3_8b", 2)
    assert tool.SHAPES == {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (12288, 4096),
                           "down": (4096, 6144), "lm_head": (75968, 4096)}
    assert tool.LAYERS == 36


def test_bad_model_or_tp_names_the_fix():
    with pytest.raises(SystemExit, match="choose from .*qwen3_8b"):
        tool.set_model("qwen9", 1)
    with pytest.raises(SystemExit, match="--tp 3 does not divide"):
        tool.set_model("qwen3_8b", 3)
