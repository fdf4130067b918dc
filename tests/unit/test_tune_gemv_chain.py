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


def test_default_shapes_are_the_ones_the_shipped_rows_were_tuned_on():
    tool.set_model("qwen3_4b", 1)
    tuned = {(row[0], row[1]) for row in gemv_configs.SHAPE_CONFIGS}
    assert tuned == {tool.SHAPES[name] for name in ("qkv", "o", "gate_up", "down")}


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
