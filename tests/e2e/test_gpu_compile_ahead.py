"""Compiling a cold process's Triton kernels ahead on a GPU (sparsekv/engine/warm_start.py): in a process with an
empty Triton cache, the engine that went through the record pass generates the same greedy tokens as one built with
compile_workers=0, for each built-in policy and both offload modes (and segmented graphs); its warm-up compiles
nothing itself, and the graphs of its record pass, which hold no Triton kernel, warn of nothing; and a second engine
of the same config finds the manifest and records nothing."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.e2e.test_cli import cli_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASE = """
import gc, json, sys
import torch
from sparsekv import LLM, SamplingParams
overrides = json.loads(sys.argv[1])
greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
prompt = [1 + (7 * i) % 500 for i in range(700)]
out = {}
for name, extra in (("ahead", []), ("again", []), ("serial", ["compile_workers=0"])):
    llm = LLM("qwen3_0_6b", overrides=["model.load_format=dummy", *overrides, *extra])
    out[name] = {"tokens": llm.generate([prompt], greedy, progress=False)[0].token_ids,
                 "startup": {k: v for k, v in llm.engine.startup.items() if isinstance(v, (int, float))}}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
print("RESULT " + json.dumps(out))
"""

CASES = {
    "full-resident": ["offload=none", "offload.num_kv_blocks=64"],
    "full-resident-segmented": ["offload=none", "offload.num_kv_blocks=64", "graph=segmented"],
    "quest-resident": ["offload=none", "offload.num_kv_blocks=64", "policy=quest", "policy.token_budget=256"],
    "xattn-resident": ["offload=none", "offload.num_kv_blocks=64", "policy=xattn_bsa"],
    "full-offload": ["offload=cpu", "offload.block_size=128", "offload.num_gpu_blocks=4", "offload.host_pool_gib=2"],
    "quest-offload": ["offload=cpu", "offload.block_size=128", "offload.num_gpu_blocks=4", "offload.host_pool_gib=2",
                      "policy=quest", "policy.token_budget=256"],
    "minference-offload": ["offload=cpu", "offload.block_size=128", "offload.num_gpu_blocks=4",
                           "offload.host_pool_gib=2", "policy=minference"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_ahead_engine_matches_a_serially_compiled_one(case, tmp_path):
    env = {**cli_env(), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    result = subprocess.run([sys.executable, "-c", CASE, json.dumps(CASES[case])], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    ahead, again, serial = out["ahead"], out["again"], out["serial"]
    assert ahead["startup"]["compiled_ahead"] > 0, ahead
    assert ahead["startup"]["compiled_in_warm_up"] == 0, ahead
    assert again["startup"]["compiled_ahead"] == 0, again  # the manifest was found: no record pass
    assert "compiled_ahead" not in serial["startup"], serial
    assert ahead["tokens"] == serial["tokens"] == again["tokens"]
    assert "The CUDA Graph is empty" not in result.stderr  # the record pass's discarded graphs stay quiet
