"""The one plugin manager: built-ins and third-party entry points, loaded once per process."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import os
import warnings
from dataclasses import dataclass, field

import pluggy

from sparsekv import hookspecs

ENTRY_POINT_GROUP = "sparsekv"
DISABLE_AUTOLOAD_ENV = "SPARSEKV_DISABLE_PLUGIN_AUTOLOAD"
log = logging.getLogger(__name__)


@dataclass
class Registry:
    models: dict[str, type] = field(default_factory=dict)  # HF architecture -> class
    policies: dict[str, type] = field(default_factory=dict)  # policy name -> class
    failed_plugins: dict[str, str] = field(default_factory=dict)  # entry point -> error


_manager: pluggy.PluginManager | None = None
_registry: Registry | None = None
_stored_configs: list[tuple[str, ...]] = []  # ConfigStore entries added by the manager (path in the repo)


def discover_entry_points(manager: pluggy.PluginManager, failed: dict[str, str]) -> None:
    """Import every `sparsekv` entry point; a plugin that fails to import is reported by name and skipped."""
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if manager.get_plugin(entry_point.name) is not None:
            continue
        try:
            module = entry_point.load()
        except Exception as exc:  # noqa: BLE001 - any import error of a third-party plugin
            where = entry_point.dist.name if entry_point.dist else "?"
            failed[entry_point.name] = f"{type(exc).__name__}: {exc}"
            message = (f"sparsekv plugin '{entry_point.name}' ({entry_point.value}, from package {where}) "
                       f"failed to import and was skipped: {type(exc).__name__}: {exc}")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            continue
        manager.register(module, name=entry_point.name)


def get_plugin_manager() -> pluggy.PluginManager:
    global _manager
    if _manager is None:
        manager = pluggy.PluginManager(ENTRY_POINT_GROUP)
        manager.add_hookspecs(hookspecs)
        manager.register(importlib.import_module("sparsekv.builtin_plugin"), name="builtin")
        failed: dict[str, str] = {}
        if os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("1", "true", "yes"):
            discover_entry_points(manager, failed)
        _manager = manager
        _build_registry(manager, failed)
    return _manager


def _build_registry(manager: pluggy.PluginManager, failed: dict[str, str]) -> None:
    global _registry
    registry = Registry(failed_plugins=failed)
    for models in manager.hook.sparsekv_register_models():
        registry.models.update(models)
    for policies in manager.hook.sparsekv_register_policies():
        for cls in policies:
            registry.policies[policy_name(cls)] = cls
    _registry = registry
    _store_configs(manager, registry)


def policy_name(cls: type) -> str:
    names = {f.name: f.default for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if not isinstance(names.get("name"), str):
        raise TypeError(f"policy class {cls.__qualname__} must be a dataclass with a `name: str = \"...\"` field")
    return names["name"]


def _store_configs(manager: pluggy.PluginManager, registry: Registry) -> None:
    from hydra.core.config_store import ConfigStore

    from sparsekv.config import store_schemas

    config_store = ConfigStore.instance()
    before = set(_config_store_entries(config_store.repo))
    store_schemas(config_store)
    for name, cls in registry.policies.items():
        config_store.store(group="policy", name=name, node=cls)
    manager.hook.sparsekv_register_configs(config_store=config_store)
    _stored_configs.extend(e for e in _config_store_entries(config_store.repo) if e not in before)


def _config_store_entries(repo: dict, prefix: tuple[str, ...] = ()):
    """Paths of the configs (leaves) in ConfigStore's nested {group: {name.yaml: ConfigNode}} repo."""
    for key, value in repo.items():
        if isinstance(value, dict):
            yield from _config_store_entries(value, prefix + (key,))
        else:
            yield prefix + (key,)


def _forget_stored_configs() -> None:
    """Remove the configs this process's manager stored, so a plugin that is no longer loaded no longer
    composes (`policy=<its policy>` fails listing the registered ones)."""
    from hydra.core.config_store import ConfigStore

    repo = ConfigStore.instance().repo
    for path in _stored_configs:
        node = repo
        for key in path[:-1]:
            node = node.get(key)
            if not isinstance(node, dict):
                break
        else:
            node.pop(path[-1], None)
    _stored_configs.clear()


def registry() -> Registry:
    get_plugin_manager()
    assert _registry is not None
    return _registry


def reset_for_tests() -> None:
    """Forget the loaded plugins and the configs they stored, so the next call rediscovers entry points
    (used by tests)."""
    global _manager, _registry
    _manager = None
    _registry = None
    _forget_stored_configs()
