"""tools/tune_prefill_attention.py --dry-run: the whole script on the CPU interpreter at tiny sizes, and its
causal FLOP count."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "tune_prefill_attention.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run checks the script on the CPU interpreter, as the "
                    "suite runs kernels off-GPU; a GPU host runs the tool itself (Triton 3.6's interpreter fails "
                    "there)")
def test_dry_run_times_checks_and_picks(tmp_path):
    out = tmp_path / "tune.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(TOOL), "--dry-run", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["status"] == "done"
    assert [s["causal"] for s in record["shapes"]] == [True, True, False]
    for shape in record["shapes"]:
        rows = shape["rows"]
        assert len(rows) >= 2 and all(r["ok"] and r["ms"] > 0 for r in rows), rows
        assert {tuple(r["config"]) for r in rows} == {(16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1)}
    entry = record["paste"].splitlines()[-1]
    assert entry.startswith("GPU_CONFIGS_SM90: dict[int, tuple[int, int, int, int]] = {32: (") and entry in proc.stdout
    # the pasted line is valid Python naming one of the timed configs
    table = ast.literal_eval(entry.split(" = ", 1)[1])
    assert table[32] in {(16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1)}


def test_visible_pairs_counts_bottom_right_causal():
    spec = importlib.util.spec_from_file_location("tune_prefill_attention", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for sq, sk in [(5, 5), (3, 9), (9, 3), (1, 1), (7, 12), (12, 7)]:
        brute = sum(1 for i in range(sq) for j in range(sk) if j <= i + sk - sq)
        assert tool.visible_pairs(sq, sk, True) == brute
        assert tool.visible_pairs(sq, sk, False) == sq * sk
    assert tool.visible_pairs(32768, 32768, True) == 32768 * 32769 // 2


def test_gluon_variants_run_at_their_constants_and_restore_the_kept_ones(monkeypatch):
    spec = importlib.util.spec_from_file_location("tune_prefill_attention", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    sm90 = tool.attention_sm90
    kept = sm90.BLOCK_N, sm90.STAGES
    seen = []

    def fake_kernel(q, k, v, scale, causal, out):
        seen.append((sm90.BLOCK_N, sm90.STAGES))
        raise RuntimeError("compile failed")

    monkeypatch.setattr(sm90, "flash_attn_sm90", fake_kernel)
    x = torch.zeros(1)
    for config in ((tool.SM90, 64, 3), tool.SM90):
        with pytest.raises(RuntimeError):
            tool.launch(x, x, x, x, x, 1.0, True, config)
        assert (sm90.BLOCK_N, sm90.STAGES) == kept
    assert seen == [(64, 3), kept]
    assert tool.label((tool.SM90, 64, 3)) == "sm90 gluon 64 keys x 3 slots"
    assert tool.label((64, 32, 4, 3)) == "64x32 w4 s3"
