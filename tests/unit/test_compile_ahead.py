"""The warm-up's compile-ahead pass (sparsekv/kernels/compile_ahead.py): on CUDA, a Triton launch inside
compile_only compiles and does not run, and the kernel is ready for the real launch; in the engine, the pass leaves
no request behind and the graph runner in place, even when it stops early."""
from __future__ import annotations

import contextlib

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.engine import llm_engine
from sparsekv.graphs.cuda_graph import attach_graph_runner
from tests.conftest import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CPU = ["device=cpu", "dtype=float32", "offload.block_size=16", "graph=eager"]


@pytest.mark.parametrize("fails", [False, True], ids=["completes", "stops-early"])
def test_compile_ahead_pass_leaves_the_engine_as_it_found_it(qwen3_ckpt, monkeypatch, fails):
    prompts = [random_prompt(33, seed=3)]
    want = [o.token_ids for o in LLM(str(qwen3_ckpt), overrides=CPU).generate(prompts, GREEDY)]
    llm = LLM(str(qwen3_ckpt), overrides=CPU)
    engine = llm.engine
    attach_graph_runner(engine, "cudagraph", llm.config.graph, emulate=True)
    runner = engine.runner.graph_runner
    entered = []

    @contextlib.contextmanager
    def fake_compile_only(workers=None):
        entered.append(engine.runner.graph_runner)  # no capture from the no-op pass
        yield
        if fails:
            raise RuntimeError("a kernel's garbage output tripped a check")

    monkeypatch.setattr(llm_engine, "compile_only", fake_compile_only)
    if fails:  # stop inside the request: it is left unfinished unless the pass aborts it
        step = engine.step
        monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("stopped")))
    engine._compile_ahead([1, 2, 3, 4, 5])
    if fails:
        monkeypatch.setattr(engine, "step", step)
    assert entered == [None]
    assert engine.runner.graph_runner is runner
    assert not engine.scheduler.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.kv_store.num_blocks
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


@pytest.mark.gpu
def test_gpu_compile_only_compiles_before_the_launch(tmp_path, monkeypatch):
    from sparsekv.kernels.compile_ahead import compile_ahead_supported, compile_only
    from sparsekv.kernels.rmsnorm import rms_norm, rms_norm_reference

    if not torch.cuda.is_available() or not compile_ahead_supported():
        pytest.skip("needs CUDA and a Triton with asynchronous compilation")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # nothing compiled before
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    with compile_only(workers=4):
        out = rms_norm(x, w, 1e-6)
    torch.cuda.synchronize()
    assert any(tmp_path.rglob("*.cubin"))  # compiled
    out = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-6), atol=2e-2, rtol=2e-2)
