"""Every shipped config composes; wrong keys, values and names fail at compose time with a message that says
what to change. No engine is built here."""
from __future__ import annotations

import dataclasses

import pytest
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from sparsekv.config import Config, ConfigError, config_dir
from sparsekv.llm import compose_config, model_overrides
from sparsekv.plugins import registry
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.full import FullAttentionPolicy

CONF = config_dir()
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
GROUP_YAMLS = sorted((p.parent.name, p.stem) for p in CONF.glob("*/*.yaml"))


def test_config_dir_holds_the_root_config_and_groups():
    assert (CONF / "config.yaml").is_file()
    for group in ("model", "graph", "policy"):
        assert group in GROUPS, f"conf/{group}/ is missing from {CONF}"
    # offload and task options are schemas in the ConfigStore (sparsekv.config, sparsekv.tasks.config)
    assert compose_config(["offload=cpu"]).offload.mode.value == "cpu"
    assert compose_config(["task=bench"]).task.name == "bench"


def test_root_config_composes_with_its_defaults():
    cfg = compose_config([])
    assert cfg.model.name == "tiny"
    assert cfg.policy.name == "full"
    assert cfg.task.name == "generate"
    assert cfg.offload.mode.value == "none"
    obj = OmegaConf.to_object(cfg)  # every MISSING filled, every value of its declared type
    assert isinstance(obj, Config)


@pytest.mark.parametrize("group,name", GROUP_YAMLS, ids=[f"{g}={n}" for g, n in GROUP_YAMLS])
def test_every_yaml_under_conf_composes(group, name):
    # model configs without weights (qwen3_4b, llama3_8b, hf ...) must compose; they fail only when built
    cfg = compose_config([f"{group}={name}"])
    assert OmegaConf.select(cfg, group) is not None
    OmegaConf.to_object(cfg)
    if group == "policy":  # a preset (quest_2k) keeps its policy's name and sets hyperparameters
        policies = registry().policies
        assert cfg.policy.name in policies, f"conf/policy/{name}.yaml selects unregistered {cfg.policy.name!r}"
        assert isinstance(OmegaConf.to_object(cfg.policy), policies[cfg.policy.name])
    elif "name" in cfg[group]:
        assert cfg[group].name == name, f"conf/{group}/{name}.yaml sets name={cfg[group].name!r}"


def test_yaml_values_reach_the_composed_config():
    cfg = compose_config(["model=llama3_8b"])
    assert cfg.model.architecture == "LlamaForCausalLM"
    assert cfg.model.eos_token_id == [128001, 128008, 128009]
    assert cfg.model.rope_scaling.rope_type == "llama3"
    assert cfg.model.path is None and cfg.model.load_format.value == "auto"


def test_every_registered_policy_composes_to_its_dataclass():
    policies = registry().policies
    assert "full" in policies
    for name, cls in policies.items():
        cfg = compose_config([f"policy={name}"])
        assert cfg.policy.name == name
        assert OmegaConf.get_type(cfg.policy) is cls
        obj = OmegaConf.to_object(cfg.policy)
        assert isinstance(obj, cls) and isinstance(obj, SparsePolicy)


def test_policy_full_is_the_full_attention_dataclass():
    cfg = compose_config(["policy=full"])
    assert cfg.policy.name == "full"
    assert OmegaConf.get_type(cfg.policy) is FullAttentionPolicy
    assert OmegaConf.to_object(cfg.policy) == FullAttentionPolicy()


def test_overrides_of_typed_values_are_converted():
    cfg = compose_config(["offload.block_size=16", "device=cpu", "dtype=float32", "scheduler.max_model_len=64"])
    assert cfg.offload.block_size == 16 and isinstance(cfg.offload.block_size, int)
    assert cfg.device.value == "cpu" and cfg.dtype.value == "float32"
    assert cfg.scheduler.max_model_len == 64


@pytest.mark.parametrize("override,key,owner,valid", [
    ("model.nope=1", "model.nope", "model", "vocab_size"),
    ("offload.nope=1", "offload.nope", "offload=none", "num_kv_blocks"),
    ("sampling.temprature=0.5", "sampling.temprature", "sampling", "temperature"),
    ("policy.nope=3", "policy.nope", "policy=full", "name"),
    ("nope=1", "nope", "the config", "scheduler"),
])
def test_wrong_key_fails_at_compose_time_naming_the_key(override, key, owner, valid):
    with pytest.raises(ConfigError) as info:
        compose_config([override])
    message = str(info.value)
    assert message.startswith(f"{key}: {owner} has no key"), message
    assert valid in message.split("valid keys: ")[1], message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("override,key,allowed", [
    ("device=gpu", "device", ["auto", "cpu", "cuda"]),
    ("offload.mode=disk", "offload.mode", ["none", "cpu"]),
    ("dtype=float8", "dtype", ["auto", "float32", "float16", "bfloat16"]),
    ("model.load_format=pt", "model.load_format", ["auto", "dummy"]),
])
def test_wrong_enum_value_fails_naming_the_key_and_the_allowed_values(override, key, allowed):
    with pytest.raises(ConfigError) as info:
        compose_config([override])
    message = str(info.value)
    assert f"key: {key})" in message, message
    assert override.split("=")[1] in message
    for value in allowed:
        assert value in message, f"{value!r} missing from: {message}"


def test_wrong_type_fails_naming_the_key():
    with pytest.raises(ConfigError) as info:
        compose_config(["offload.block_size=big"])
    assert "offload.block_size" in str(info.value) and "big" in str(info.value)


def test_unknown_model_name_lists_the_available_models():
    with pytest.raises(MissingConfigException) as info:
        compose_config(["model=nope"])
    message = str(info.value)
    assert "model/nope" in message
    for _, name in [gn for gn in GROUP_YAMLS if gn[0] == "model"]:
        assert name in message


def test_unknown_policy_name_lists_the_registered_policies():
    with pytest.raises(MissingConfigException) as info:
        compose_config(["policy=nope"])
    message = str(info.value)
    assert "policy/nope" in message
    for name in registry().policies:
        assert f"\t{name}\n" in message or message.endswith(f"\t{name}"), message


def test_schema_dataclasses_have_defaults_for_every_key():
    """A key without a default (other than the selected groups) would make every run spell it out."""
    groups = {"model", "offload", "graph", "policy", "task"}
    for f in dataclasses.fields(Config):
        if f.name not in groups:
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name


@pytest.mark.parametrize("path", ["/tmp/plain_dir-1.0/ckpt", "/tmp/with space/ckpt", "/tmp/a,b=c[d]/x",
                                  "/tmp/it's/x", "/tmp/back\\slash end\\", "/tmp/${oops} dir"])
def test_checkpoint_paths_survive_hydra_override_parsing(path):
    overrides = model_overrides(path)
    assert overrides[0] == "model=hf"
    assert compose_config(overrides).model.path == path


def test_model_overrides_tells_names_from_directories(tmp_path):
    assert model_overrides(None) == []
    assert model_overrides("tiny") == ["model=tiny"]
    assert model_overrides(str(tmp_path))[0] == "model=hf"
