"""Start-up: no torch._dynamo import in a generate run, nn.init skipped while a model is built, the engine's warm-up,
and the start-up / compile / steady-state figures of task=generate."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.graphs.cuda_graph import attach_graph_runner
from sparsekv.models.loader import SkipInit
from tests.conftest import random_prompt
from tests.e2e.test_cli import cli_env

CPU = ["device=cpu", "dtype=float32"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

# `python -m sparsekv` in a fresh interpreter, reporting at exit whether torch._dynamo was ever imported
RUN_CLI_AND_REPORT_DYNAMO = """
import atexit, runpy, sys
atexit.register(lambda: print("torch._dynamo imported:", "torch._dynamo" in sys.modules))
sys.argv = ["sparsekv", *sys.argv[1:]]
runpy.run_module("sparsekv", run_name="__main__")
"""

PHASE_FIELDS = ("startup_seconds", "import_config_seconds", "build_seconds", "weights_seconds", "kv_seconds",
                "compile_seconds", "kernel_compile_seconds", "graph_capture_seconds", "prefill_tok_s",
                "decode_ms_per_token")


def test_generate_run_never_imports_dynamo_and_records_its_phases(tmp_path):
    """torch._dynamo costs seconds to import; nothing in a generate run needs it (a model built on the meta device
    would import it through torch._refs). The record and the printed summary separate the phases."""
    result = subprocess.run([sys.executable, "-c", RUN_CLI_AND_REPORT_DYNAMO, "device=cpu", "sampling.max_tokens=4"],
                            cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch._dynamo imported: False" in result.stdout, result.stdout
    record = json.loads(next(tmp_path.glob("outputs/*/*/generate.json")).read_text())
    missing = [key for key in PHASE_FIELDS if key not in record]
    assert not missing, missing
    assert record["startup_seconds"] >= record["build_seconds"] >= record["weights_seconds"] >= 0
    assert record["compile_seconds"] == record["kernel_compile_seconds"] + record["graph_capture_seconds"] == 0.0  # CPU
    assert record["prefill_tok_s"] > 0 and record["decode_ms_per_token"] > 0
    line = next(line for line in result.stdout.splitlines() if line.startswith("start-up "))
    assert "compile " in line and f"prefill {record['prefill_tok_s']:.1f} tok/s" in line, line
    assert f"decode {record['decode_ms_per_token']:.2f} ms/token" in line, line


def test_skip_init_leaves_tensors_untouched_and_runs_everything_else():
    weight = torch.zeros(4, 3)
    with SkipInit():
        torch.nn.init.normal_(weight)
        torch.nn.init.kaiming_uniform_(weight, a=5 ** 0.5)
        linear = torch.nn.Linear(3, 4, bias=True)  # its reset_parameters fills nothing
        summed = weight + 1  # other torch calls run as usual
    assert torch.equal(weight, torch.zeros(4, 3)) and torch.equal(summed, torch.ones(4, 3))
    assert linear.weight.shape == (4, 3) and linear.bias.shape == (4,)
    torch.nn.init.normal_(weight)  # outside the mode: initialized again
    assert weight.abs().sum() > 0


def test_build_model_makes_each_weight_once_in_its_dtype(qwen3_ckpt):
    """Built on its device in its dtype (no float32 copy first): the same weights as the checkpoint, tied
    embeddings shared, the rotary frequencies in float32."""
    llm = LLM(str(qwen3_ckpt), overrides=["device=cpu", "dtype=bfloat16"])
    model = llm.engine.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.inv_freq.dtype == torch.float32
    assert model.lm_head.weight is model.embed_tokens.weight
    from safetensors.torch import load_file

    saved = load_file(str(next(qwen3_ckpt.glob("*.safetensors"))))
    torch.testing.assert_close(model.embed_tokens.weight, saved["model.embed_tokens.weight"].to(torch.bfloat16))


def test_warm_up_captures_batch_one_and_resets_the_figures(qwen3_ckpt):
    """The warm-up (run at build on CUDA) compiles and captures outside any request's figures: afterwards the run's
    figures and replay counters are zero, batch size 1's graph exists, and requests give the tokens they give
    without it."""
    prompts = [random_prompt(41, seed=5)]
    overrides = CPU + ["offload.block_size=16", "graph=eager"]
    want = [o.token_ids for o in LLM(str(qwen3_ckpt), overrides=overrides).generate(prompts, GREEDY)]
    llm = LLM(str(qwen3_ckpt), overrides=overrides)
    engine = llm.engine
    attach_graph_runner(engine, "cudagraph", llm.config.graph, emulate=True)
    sampled_rows = []
    sample_row = engine.runner.sampler._sample_row
    engine.runner.sampler._sample_row = lambda logits, p, seq_id: sampled_rows.append(p) or sample_row(logits, p,
                                                                                                         seq_id)
    assert engine.warm_up() > 0
    # the sampled path (top-k, top-p, multinomial) ran too, so a sampled request loads no kernel in its figures
    assert sampled_rows and all(p.top_k > 0 and p.top_p < 1.0 for p in sampled_rows)
    runner = engine.runner.graph_runner
    assert engine.graph_stats["batch_sizes"] == [1] and engine.startup["warmup_capture_seconds"] > 0
    assert engine.stats.decode_steps == 0 and engine.stats.prompt_tokens == 0
    assert runner.replayed_steps == 0 and runner.eager_steps == 0
    assert not engine.scheduler.has_unfinished() and engine.block_manager.num_free_blocks == engine.kv_store.num_blocks
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    summary = engine.summary()
    assert summary["graph_capture_seconds"] == engine.graph_stats["capture_seconds"]
    assert summary["compile_seconds"] == pytest.approx(summary["kernel_compile_seconds"] +
                                                       summary["graph_capture_seconds"])
    assert runner.replayed_steps == GREEDY.max_tokens - 1 and engine.graph_stats["batch_sizes"] == [1]



@pytest.mark.gpu
def test_gpu_generate_run_compiles_at_build_and_never_imports_dynamo(tmp_path):
    """On CUDA the engine's warm-up compiles the kernels and captures batch size 1 at build: the record's compile
    figures are positive, the request's figures are its own, and torch._dynamo is never imported."""
    result = subprocess.run([sys.executable, "-c", RUN_CLI_AND_REPORT_DYNAMO, "device=cuda", "sampling.max_tokens=16"],
                            cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch._dynamo imported: False" in result.stdout, result.stdout
    record = json.loads(next(tmp_path.glob("outputs/*/*/generate.json")).read_text())
    assert record["kernel_compile_seconds"] > 0 and record["graph_capture_seconds"] > 0
    assert record["prefill_tok_s"] > 0 and record["decode_ms_per_token"] > 0


@pytest.mark.gpu
def test_gpu_llm_is_warm_after_construction(qwen3_ckpt):
    llm = LLM(str(qwen3_ckpt), overrides=["device=cuda", "dtype=bfloat16", "offload.block_size=16"])
    engine = llm.engine
    assert engine.graph_stats["batch_sizes"] == [1] and engine.startup["warmup_seconds"] > 0
    assert engine.stats.decode_steps == 0 and engine.runner.graph_runner.replayed_steps == 0
    captured = engine.graph_stats["capture_seconds"]
    llm.generate([random_prompt(41, seed=5)], GREEDY)
    assert engine.graph_stats["capture_seconds"] == captured  # nothing captured inside the request
    assert engine.runner.graph_runner.replayed_steps == GREEDY.max_tokens - 1
