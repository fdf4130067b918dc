"""Bad input is a clear error raised before any compute: before the weights are built for engine-level
mistakes, before the model runs for request-level ones, and without leaving anything queued."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException

import sparsekv.factory
from sparsekv import LLM, SamplingParams
from sparsekv.kvcache.base import format_bytes
from sparsekv.plugins import registry

CPU = ["device=cpu"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", overrides=CPU)


@pytest.fixture
def no_compute(llm, monkeypatch):
    """Any model step fails the test; the engine must also be left with nothing queued."""
    calls = []

    def forbidden(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model ran before the bad input was rejected")

    monkeypatch.setattr(llm.engine.runner, "run", forbidden)
    yield llm
    assert not calls
    assert not llm.engine.scheduler.has_unfinished()


@pytest.fixture
def no_weights(monkeypatch):
    """Engine-level input errors are raised before the weights are built."""
    def forbidden(*args, **kwargs):
        raise AssertionError("weights were built before the bad input was rejected")

    monkeypatch.setattr(sparsekv.factory, "build_model", forbidden)


# ---- engine-level: LLM(...)

def test_unknown_model_name_lists_the_available_models(no_weights):
    with pytest.raises(MissingConfigException) as info:
        LLM("nope", overrides=CPU)
    message = str(info.value)
    assert "model/nope" in message
    for name in ("tiny", "qwen3_4b", "llama3_8b", "hf"):
        assert name in message


def test_unknown_policy_name_lists_the_registered_policies(no_weights):
    with pytest.raises(MissingConfigException) as info:
        LLM("tiny", overrides=CPU + ["policy=nope"])
    message = str(info.value)
    assert "policy/nope" in message
    for name in registry().policies:
        assert name in message


def test_model_without_weights_says_how_to_get_some(no_weights):
    with pytest.raises(ValueError) as info:
        LLM("qwen3_4b", overrides=CPU)
    assert "model.path=" in str(info.value) and "model.load_format=dummy" in str(info.value)


def test_missing_checkpoint_directory_names_the_path(no_weights):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        LLM("/nonexistent/dir", overrides=CPU)
    assert "/nonexistent/dir" in str(info.value)


def test_directory_without_config_json_names_the_path(tmp_path, no_weights):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        LLM(str(tmp_path), overrides=CPU)
    assert str(tmp_path) in str(info.value) and "config.json" in str(info.value)


def test_unregistered_architecture_lists_the_registered_ones(tmp_path, no_weights):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["FooForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}))
    with pytest.raises(ValueError) as info:
        LLM(str(tmp_path), overrides=CPU)
    message = str(info.value)
    assert "FooForCausalLM" in message
    for arch in registry().models:
        assert arch in message
    assert "Qwen3ForCausalLM" in message and "LlamaForCausalLM" in message


def test_bad_sampling_config_fails_before_weights(no_weights):
    from sparsekv.llm import compose_config
    from sparsekv.tasks.generate import run

    with pytest.raises(ValueError, match="top_p"):
        run(compose_config(CPU + ["sampling.top_p=0"]))


# ---- request-level: generate(...)

def test_prompt_longer_than_max_model_len_names_both_numbers(monkeypatch):
    short = LLM("tiny", overrides=CPU + ["scheduler.max_model_len=64"])
    monkeypatch.setattr(short.engine.runner, "run", lambda *a: pytest.fail("model ran"))
    with pytest.raises(ValueError) as info:
        short.generate([list(range(3, 103))], GREEDY)
    message = str(info.value)
    assert "100" in message and "64" in message and "max_model_len" in message
    with pytest.raises(ValueError, match="100"):  # a string prompt too (byte tokenizer: BOS + 99 bytes)
        short.generate("x" * 99, GREEDY)
    assert not short.engine.scheduler.has_unfinished()


@pytest.mark.parametrize("prompt", ["", [], [[]], [""]], ids=["empty-str", "empty-list", "empty-token-list",
                                                               "batch-of-empty-str"])
def test_empty_prompt(no_compute, prompt):
    with pytest.raises(ValueError, match="empty"):
        no_compute.generate(prompt, GREEDY)


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
])
def test_bad_sampling_params_fail_at_construction(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as info:
        SamplingParams(**kwargs)
    assert str(next(iter(kwargs.values()))) in str(info.value)


@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"top_k": 1.5}, "top_k"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"seed": "abc"}, "seed"),
])
def test_malformed_sampling_params_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_integral_sampling_values_are_normalized():
    params = SamplingParams(max_tokens=16.0, top_k=4.0, stop_token_ids=(3.0, 4), seed=2.0)
    assert params.max_tokens == 16 and isinstance(params.max_tokens, int)
    assert params.top_k == 4 and params.stop_token_ids == [3, 4] and params.seed == 2


@pytest.mark.parametrize("prompts,needle", [
    (None, "NoneType"),
    (42, "int"),
    ([[1.7, 2.0]], "1.7"),
    ([["a", "b"]], "'a'"),
    ([[True, False]], "True"),
    ([[1, 2], None], "prompt 1"),
    ([1, 2, "x"], "'x'"),
], ids=["none", "int", "float-ids", "str-ids", "bool-ids", "none-in-batch", "str-in-token-list"])
def test_wrong_prompt_types_are_clear_type_errors(no_compute, prompts, needle):
    with pytest.raises(TypeError) as info:
        no_compute.generate(prompts, GREEDY)
    assert needle in str(info.value)


def test_wrong_sampling_params_type(no_compute):
    with pytest.raises(TypeError, match="SamplingParams"):
        no_compute.generate([[1, 2]], {"max_tokens": 2})


@pytest.mark.parametrize("bad", [512, 100000, -1])
def test_token_id_outside_the_vocabulary(no_compute, bad):
    with pytest.raises(ValueError) as info:
        no_compute.generate([[1, 2, bad, 3]], GREEDY)
    assert str(bad) in str(info.value) and "512" in str(info.value)


def test_wrong_number_of_sampling_params(no_compute):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        no_compute.generate([[1], [2], [3]], [GREEDY, GREEDY])


@pytest.mark.parametrize("bad_index", [0, 2])
def test_bad_prompt_in_a_batch_queues_nothing_and_the_engine_still_works(llm, monkeypatch, bad_index):
    prompts = ["good one", [5, 6, 7], "another good one"]
    prompts[bad_index] = [1, 2, 999999]
    with monkeypatch.context() as patch:
        patch.setattr(llm.engine.runner, "run", lambda *a: pytest.fail("model ran"))
        with pytest.raises(ValueError, match="999999"):
            llm.generate(prompts, GREEDY)
    assert not llm.engine.scheduler.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.kv_store.num_blocks  # no blocks leaked
    outs = llm.generate(["good one", [5, 6, 7]], GREEDY)
    assert [len(o.token_ids) for o in outs] == [3, 3]
    assert all(o.finish_reason == "length" for o in outs)
    # and a too-long prompt in a batch: same guarantees
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5, 6, 7], list(range(3, 500)) * 10], GREEDY)
    assert not llm.engine.scheduler.has_unfinished()
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 3


# ---- the CLI: values beyond the machine fail in one line (exit 2) before the weights load

def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               SPARSEKV_DISABLE_PLUGIN_AUTOLOAD="1")
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "sparsekv", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("args,needles", [
    (["offload=cpu", "offload.host_pool_gib=500000"], ["host_pool_gib=500000", "available host memory",
                                                       "leave it unset"]),
    (["offload=cpu", "offload.host_pool_gib=-1"], ["host_pool_gib=-1", "> 0"]),
    (["offload.gpu_memory_utilization=5"], ["gpu_memory_utilization=5", "<= 1"]),
    (["offload.num_kv_blocks=-3"], ["num_kv_blocks=-3", ">= 1"]),
    (["offload.num_kv_blocks=0"], ["num_kv_blocks=0", ">= 1"]),
    (["offload.num_kv_blocks=1000000000"], ["num_kv_blocks=1000000000", "GiB", "leave it unset"]),
    (["scheduler.max_model_len=100000000000"], ["max_model_len=100000000000", "GiB", "lower scheduler.max_model_len"]),
    (["output_dir=FILE/out"], ["output_dir=", "not a directory", "writable directory"]),
], ids=["host-pool-beyond-ram", "host-pool-negative", "gpu-util-above-1", "kv-blocks-negative", "kv-blocks-zero",
        "kv-blocks-beyond-ram", "max-model-len-beyond-ram", "output-dir-unwritable"])
def test_cli_rejects_values_beyond_the_machine(tmp_path, args, needles):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = [arg.replace("FILE", str(blocker)) for arg in args]
    result = run_cli(["device=cpu", *args], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, result.stderr
    for needle in needles:
        assert needle in error_lines[0]


def test_failed_run_writes_its_error_into_the_run_log(tmp_path):
    result = run_cli(["device=cpu", "offload=cpu", "offload.host_pool_gib=500000"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    logs = list(tmp_path.glob("outputs/*/*/*.log"))
    assert len(logs) == 1, list(tmp_path.rglob("*"))
    text = logs[0].read_text()
    assert "host_pool_gib=500000" in text and "leave it unset" in text
    assert result.stderr.count("host_pool_gib=500000") == 1  # the terminal still shows the error once


def test_small_figures_are_shown_in_mib():
    assert format_bytes(3 << 20) == "3.00 MiB"
    assert format_bytes(3 << 30) == "3.00 GiB"
