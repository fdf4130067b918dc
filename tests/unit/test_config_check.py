"""One validation path for every composed config (sparsekv.config_check): keys no schema has are rejected also in
their `+`/`++` forms, numeric keys are range-checked, offload modes and tasks have their own keys, per_policy sets
a hyperparameter only for the policy that has it, and the config's `sampling` is the API's default."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sparsekv import LLM, PolicyConfigError
from sparsekv.config import OFFLOAD_SCHEMAS, Config, ConfigError, GraphConfig, ModelConfig, SchedulerConfig
from sparsekv.llm import compose_config
from sparsekv.sampling_params import SamplingParams
from sparsekv.tasks.config import TASK_SCHEMAS
from tests.e2e.test_cli import run_cli

NODES = {  # path -> (overrides that select it, a key it has)
    "model": ([], "vocab_size"), "scheduler": ([], "max_num_seqs"), "sampling": ([], "temperature"),
    "graph": ([], "max_batch_size"), "offload": (["offload=cpu"], "num_gpu_blocks"),
    "policy": (["policy=quest"], "token_budget"), "task": (["task=bench"], "context"), "": ([], "seed"),
    "per_policy.quest": ([], "token_budget"),
}


@pytest.mark.parametrize("prefix", ["", "+", "++"])
@pytest.mark.parametrize("path", list(NODES))
def test_a_key_no_schema_has_is_rejected_in_every_override_form(path, prefix):
    select, valid = NODES[path]
    key = f"{path}.not_a_key" if path else "not_a_key"
    with pytest.raises(ConfigError) as info:
        compose_config(select + [f"{prefix}{key}=1"])
    message = str(info.value)
    assert message.startswith(f"{key}: ") and "has no key 'not_a_key'" in message, message
    assert valid in message.split("valid keys: ")[1], message


def test_force_added_policy_key_of_another_policy_points_at_per_policy():
    with pytest.raises(ConfigError, match=r"policy=full has no key 'token_budget'.*per_policy\.quest\.token_budget"):
        compose_config(["++policy.token_budget=128"])


@pytest.mark.parametrize("mode,key", [("none", "num_gpu_blocks"), ("none", "prefill_chunk_size"),
                                      ("none", "host_pool_gib"), ("none", "prefill_mode"),
                                      ("cpu", "num_kv_blocks"), ("cpu", "gpu_memory_utilization")])
def test_offload_keys_exist_only_for_their_mode(mode, key):
    other = "cpu" if mode == "none" else "none"
    value = "chunked" if key == "prefill_mode" else "2"
    with pytest.raises(ConfigError) as info:
        compose_config([f"offload={mode}", f"offload.{key}={value}"])
    message = str(info.value)
    assert f"offload.{key}: offload={mode} has no key" in message and f"a key of offload={other}" in message


def test_offload_mode_is_chosen_by_the_group_not_the_key():
    with pytest.raises(ConfigError, match="select the KV store with offload=cpu"):
        compose_config(["offload.mode=cpu"])


def test_task_settings_live_under_the_selected_task():
    assert compose_config(["task=bench", "task.context=32768"]).task.context == 32768
    with pytest.raises(ConfigError, match=r"task.context: task=generate has no key 'context'.*task=bench"):
        compose_config(["task=generate", "task.context=32768"])
    with pytest.raises(ConfigError, match=r"task settings live under `task`: task=bench"):
        compose_config(["task=generate", "bench.context=32768"])
    with pytest.raises(ConfigError, match="select the task with task=bench"):
        compose_config(["task.name=bench"])


def out_of_range(bounds: tuple) -> float:
    ge, gt, le = bounds
    return le + 1 if le is not None else (ge - 1 if ge is not None else gt - 1)


def bounded_keys():
    schemas = [("model", [], ModelConfig), ("scheduler", [], SchedulerConfig), ("graph", [], GraphConfig),
               ("", [], Config)]
    schemas += [("offload", [f"offload={mode}"], cls) for mode, cls in OFFLOAD_SCHEMAS.items()]
    schemas += [("task", [f"task={name}"], cls) for name, cls in TASK_SCHEMAS.items()]
    for path, select, cls in schemas:
        for f in dataclasses.fields(cls):
            if "range" in f.metadata:
                yield pytest.param(path, select, f, id=f"{path or 'top'}.{f.name}")


@pytest.mark.parametrize("path,select,f", list(bounded_keys()))
def test_every_numeric_key_is_range_checked_at_compose_time(path, select, f):
    key = f"{path}.{f.name}" if path else f.name
    value = out_of_range(f.metadata["range"])
    value = int(value) if "int" in str(f.type) else value
    shown = f"[{value}]" if "List" in str(f.type) else f"{value}"
    with pytest.raises(ConfigError, match=rf"^{key}=.* is out of range; it must be "):
        compose_config(select + [f"{key}={shown}"])


def test_builtin_policy_range_error_is_a_policy_config_error():
    with pytest.raises(PolicyConfigError, match=r"^policy=quest: .*token_budget"):
        compose_config(["policy=quest", "policy.token_budget=-1"])


def test_sampling_values_are_checked_at_compose_time():
    with pytest.raises(ConfigError, match="top_p"):
        compose_config(["sampling.top_p=3"])


def test_per_policy_applies_only_to_the_selected_policy():
    quest = compose_config(["policy=quest", "per_policy.quest.token_budget=64", "per_policy.xattn_bsa.threshold=0.5"])
    assert quest.policy.token_budget == 64 and quest.per_policy is None
    full = compose_config(["policy=full", "per_policy.quest.token_budget=64"])
    assert set(full.policy) == {"name"} and full.per_policy is None
    preset = compose_config(["policy=quest_4k"])
    assert preset.policy.token_budget == 4096  # presets untouched by the unset per_policy entries
    with pytest.raises(ConfigError, match=r"per_policy.nope: per_policy has no key 'nope'; valid keys: .*quest"):
        compose_config(["per_policy.nope.token_budget=64"])
    with pytest.raises(ConfigError, match="per_policy.quest.token_budgt"):
        compose_config(["per_policy.quest.token_budgt=64"])


def test_one_definition_of_the_sampling_defaults():
    assert dataclasses.asdict(SamplingParams()) == dict(compose_config([]).sampling)


def test_the_api_honours_the_configs_sampling():
    llm = LLM(overrides=["device=cpu", "dtype=float32", "sampling.max_tokens=3", "sampling.temperature=0",
                         "sampling.ignore_eos=true"])
    out = llm.generate([1, 2, 3])[0]
    assert len(out.token_ids) == 3
    assert llm.generate([1, 2, 3])[0].token_ids == out.token_ids  # greedy
    assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids) == 5


def test_cli_rejects_a_misspelled_key_in_one_line_listing_the_valid_keys(tmp_path):
    for args in (["policy=quest", "policy.token_budgt=1024"], ["policy=quest", "+policy.token_budgt=1024"]):
        result = run_cli(args, tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            "error: policy.token_budgt: policy=quest has no key 'token_budgt'; valid keys: name, token_budget, "
            "topk_blocks, threshold_blocks, dense_layers"], result.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_sweep_with_a_bad_job_fails_before_the_first_job(tmp_path):
    result = run_cli(["-m", "policy=full,quest", "policy.token_budget=128"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "per_policy.quest.token_budget" in result.stderr and "(in the job policy=full" in result.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_sweep_sets_each_policy_its_own_keys(tmp_path):
    result = run_cli(["-m", "device=cpu", "sampling.max_tokens=2", "policy=full,quest",
                      "per_policy.quest.token_budget=64,128", f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(p.read_text())["config"] for p in sorted(Path(tmp_path / "sweep").glob("*/generate.json"))]
    assert len(records) == 4
    policies = sorted((c["policy"]["name"], c["policy"].get("token_budget")) for c in records)
    assert policies == [("full", None), ("full", None), ("quest", 64), ("quest", 128)]
    assert all(set(c["policy"]) == {"name"} for c in records if c["policy"]["name"] == "full")
    assert all(c["per_policy"] is None for c in records)
