"""The one validation path for a composed config (each CLI job, the CLI's check of a whole sweep before the first
job, `LLM(overrides=...)`): `per_policy` applied, keys that no schema has rejected (also those added with `+` or
`++`), every numeric key in its range, sampling and the policy constructed once, all before any weights load."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING

from omegaconf import DictConfig, ListConfig, OmegaConf

from sparsekv.config import OFFLOAD_SCHEMAS, Config, ConfigError, parse_gpu_cache_gib
from sparsekv.errors import PolicyConfigError
from sparsekv.sampling_params import SamplingParams
from sparsekv.tasks.config import TASK_SCHEMAS

if TYPE_CHECKING:
    from sparsekv.policies.base import SparsePolicy
    from sparsekv.policies.context import KVLayout

GROUPS = {"offload": OFFLOAD_SCHEMAS, "task": TASK_SCHEMAS}


def _policies() -> dict[str, type]:
    from sparsekv.plugins import registry

    return registry().policies


def _group_options(group: str) -> dict[str, type]:
    return _policies() if group == "policy" else GROUPS.get(group, {})


def _fields(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def _owner(path: str, schema: type) -> str:
    """How the node is named to the user: `policy=full`, `offload=cpu`, `scheduler`, `the config`."""
    if path in ("policy", "offload", "task"):
        for name, cls in _group_options(path).items():
            if cls is schema:
                return f"{path}={name}"
    return path or "the config"


def unknown_key_error(path: str, key: str, schema: type) -> ConfigError:
    """`<key>: <owner> has no key '<key>'; valid keys: ...` plus where the key does exist."""
    full_key = f"{path}.{key}" if path else key
    message = f"{full_key}: {_owner(path, schema)} has no key '{key}'; valid keys: {', '.join(_fields(schema))}"
    if path in ("policy", "offload", "task"):
        others = [name for name, cls in sorted(_group_options(path).items())
                  if dataclasses.is_dataclass(cls) and key in _fields(cls)]
        if others:
            message += f" ('{key}' is a key of {', '.join(f'{path}={o}' for o in others)}"
            if path == "policy":
                message += (f"; to set it only for the policy that has it, e.g. in a sweep over policies, use "
                            f"per_policy.{others[0]}.{key}=...")
            message += ")"
    elif not path and key in TASK_SCHEMAS:
        message += f" (task settings live under `task`: task={key} task.<key>=...)"
    return ConfigError(message)


def check_keys(node: DictConfig, path: str = "") -> None:
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    valid = set(_fields(schema))
    for key in node.keys():
        if key not in valid:
            raise unknown_key_error(path, str(key), schema)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            check_keys(child, f"{path}.{key}" if path else str(key))


def _range_text(ge, gt, le) -> str:
    parts = [f">= {ge}" if ge is not None else None, f"> {gt}" if gt is not None else None,
             f"<= {le}" if le is not None else None]
    return " and ".join(p for p in parts if p)


def check_ranges(node: DictConfig, path: str = "") -> None:
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    for f in dataclasses.fields(schema):
        if f.name not in node or OmegaConf.is_missing(node, f.name):
            continue
        full_key = f"{path}.{f.name}" if path else f.name
        value = node[f.name]
        if isinstance(value, DictConfig):
            check_ranges(value, full_key)
            continue
        bounds = f.metadata.get("range")
        if bounds is None or value is None:
            continue
        for item in (value if isinstance(value, ListConfig) else [value]):
            ge, gt, le = bounds
            ok = (isinstance(item, numbers.Real) and not isinstance(item, bool) and not math.isnan(item)
                  and (ge is None or item >= ge) and (gt is None or item > gt) and (le is None or item <= le))
            if not ok:
                shown = f"{full_key}={item!r}" if item is value else f"{full_key}={list(value)!r}: element {item!r}"
                raise ConfigError(f"{shown} is out of range; it must be {_range_text(ge, gt, le)}")


def check_selections(cfg: DictConfig) -> None:
    """A group's selector key set directly would keep the other option's schema: ask for the group instead."""
    schema = OmegaConf.get_type(cfg.offload)
    mode = getattr(cfg.offload.mode, "value", cfg.offload.mode)
    if OFFLOAD_SCHEMAS.get(mode) is not schema:
        raise ConfigError(f"offload.mode={mode}: select the KV store with offload={mode} (its keys differ from "
                          f"{_owner('offload', schema)}'s)")
    if TASK_SCHEMAS.get(cfg.task.name) is not OmegaConf.get_type(cfg.task):
        raise ConfigError(f"task.name={cfg.task.name}: select the task with task={cfg.task.name}")
    if _policies().get(cfg.policy.name) is not OmegaConf.get_type(cfg.policy):
        raise ConfigError(f"policy.name={cfg.policy.name}: select the policy with policy={cfg.policy.name}")


def apply_per_policy(cfg: DictConfig) -> None:
    """per_policy.<selected policy>.<key> -> policy.<key>; the node is then dropped, so a job's record shows only
    the keys its own policy has."""
    per_policy = cfg.get("per_policy")
    if per_policy is None:
        return
    settings = per_policy.get(cfg.policy.name)
    if settings is not None:
        for key in settings.keys():
            if not OmegaConf.is_missing(settings, key):
                cfg.policy[key] = settings[key]
    cfg.per_policy = None


def build_policy(policy_cfg: DictConfig):
    """The policy instance; an out-of-range hyperparameter (PolicyConfigError or any ValueError from the policy's
    __post_init__) becomes one PolicyConfigError naming the policy and, for a plugin, its package."""
    from sparsekv.plugins import registry

    policies = registry().policies
    name = policy_cfg.get("name") if policy_cfg is not None else None
    if name not in policies:
        raise ConfigError(f"policy={name} is not registered; registered: {', '.join(sorted(policies))}")
    try:
        policy = OmegaConf.to_object(policy_cfg)
        if not isinstance(policy, policies[name]):
            policy = policies[name](**policy)
    except ValueError as exc:
        raise PolicyConfigError(f"{policy_origin(name)}: {exc}") from exc
    return policy


def check_policy_layout(policy: SparsePolicy, layout: KVLayout) -> None:
    """SparsePolicy.check_layout before the weights load; its ValueError becomes one PolicyConfigError naming the
    policy and, for a plugin, its package."""
    try:
        policy.check_layout(layout)
    except ValueError as exc:
        raise PolicyConfigError(f"{policy_origin(policy.name)}: {exc}") from exc


def policy_origin(name: str) -> str:
    """'policy=NAME', and for a plugin's policy its plugin and package: how errors about a policy name it."""
    from sparsekv.plugins import registry

    owner = registry().policy_owner(name)
    where = "" if owner is None or owner.name == "builtin" else f" (plugin '{owner.name}', package {owner.package})"
    return f"policy={name}{where}"


def check_config(cfg: DictConfig) -> DictConfig:
    """Validate (and finish: per_policy) a composed config in place; returns it."""
    if not isinstance(cfg, DictConfig) or OmegaConf.get_type(cfg) is not Config:
        raise TypeError(f"expected a composed sparsekv config, got {type(cfg).__name__}")
    check_keys(cfg)
    apply_per_policy(cfg)
    check_selections(cfg)
    check_ranges(cfg)
    if "gpu_cache_gib" in cfg.offload:
        parse_gpu_cache_gib(cfg.offload.gpu_cache_gib)
    try:
        SamplingParams(**OmegaConf.to_container(cfg.sampling))
    except ValueError as exc:
        raise ConfigError(f"sampling: {exc}") from exc
    build_policy(cfg.policy)
    if cfg.task.name == "ruler":
        from sparsekv.tasks.ruler.settings import check_ruler_config

        try:
            check_ruler_config(cfg.task)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    return cfg


def explain_composition_error(exc: Exception) -> ConfigError:
    """Hydra's own composition error in the same words as check_config's: an unknown key names the key and lists
    the valid ones; a wrong value gives OmegaConf's reason ("Invalid value 'gpu', expected one of [auto, cpu,
    cuda]"), which Hydra keeps only in __cause__."""
    cause = exc.__cause__
    if cause is None:
        return ConfigError(str(exc).strip())
    full_key = getattr(cause, "full_key", None)
    schema = getattr(cause, "object_type", None)
    if (type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError") and full_key
            and dataclasses.is_dataclass(schema)):
        path, _, key = str(full_key).rpartition(".")
        return unknown_key_error(path, key, schema)
    reason = str(getattr(cause, "msg", None) or cause).strip().splitlines()[0]
    first = str(exc).strip().splitlines()[0]
    return ConfigError(f"{first}: {reason} (key: {full_key})" if full_key else f"{first}: {reason}")
