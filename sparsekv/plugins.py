"""The one plugin manager: built-ins and third-party entry points, loaded once per process.

Each plugin is loaded in isolation: an import error, a hook that raises, a hook that returns the wrong type, a
misspelled hook or a name another package already registers skips that plugin (one warning naming its package
and entry point, kept in `Registry.plugins`) and everything else loads.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import warnings
from dataclasses import dataclass, field
from types import ModuleType

import pluggy

from sparsekv import hookspecs

ENTRY_POINT_GROUP = "sparsekv"
DISABLE_AUTOLOAD_ENV = "SPARSEKV_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_LIST_ENV = "SPARSEKV_PLUGINS"  # comma-separated entry-point names: only these load
BUILTIN = "builtin"


class PluginError(Exception):
    """Why one plugin was skipped; the message is shown after the plugin's name and package."""


@dataclass
class PluginInfo:
    """One plugin as `task=plugins` lists it."""
    name: str  # entry-point name ("builtin" for sparsekv's own)
    package: str  # distribution that provides it
    module: str  # the entry point's value, e.g. "my_package.plugin"
    status: str = "loaded"  # loaded | failed | not allowed
    error: str | None = None
    policies: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"plugin '{self.name}' (entry point {self.name} = {self.module}, package {self.package})"


@dataclass
class Registry:
    models: dict[str, type] = field(default_factory=dict)  # HF architecture -> class
    policies: dict[str, type] = field(default_factory=dict)  # policy name -> class
    plugins: dict[str, PluginInfo] = field(default_factory=dict)  # entry-point name -> what it did

    @property
    def failed_plugins(self) -> dict[str, str]:
        """entry-point name -> why it was skipped"""
        return {name: info.error or "" for name, info in self.plugins.items() if info.status == "failed"}

    def policy_owner(self, policy: str) -> PluginInfo | None:
        return next((p for p in self.plugins.values() if policy in p.policies and p.status == "loaded"), None)


_manager: pluggy.PluginManager | None = None
_registry: Registry | None = None
_stored_configs: list[tuple[str, ...]] = []  # ConfigStore entries added by the manager (path in the repo)


def hook_names() -> list[str]:
    return sorted(n for n, obj in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("sparsekv_"))


def check_hook_names(module: ModuleType) -> None:
    """pluggy ignores a function whose name is not a hook (`sparsekv_register_policy`) and one without
    @sparsekv.hookimpl; both are a plugin author's typo, so both are errors."""
    valid = hook_names()
    for attr, obj in vars(module).items():
        if not attr.startswith("sparsekv_") or not callable(obj) or inspect.ismodule(obj):
            continue
        marked = hasattr(obj, f"{ENTRY_POINT_GROUP}_impl")
        if getattr(obj, "__module__", None) != module.__name__ and not marked:
            continue
        if attr not in valid:
            raise PluginError(f"{attr} is not a sparsekv hook; valid hooks: {', '.join(valid)}")
        if not marked:
            raise PluginError(f"{attr} lacks the @sparsekv.hookimpl decorator, so it would never be called")


def policy_name(cls: type) -> str:
    names = {f.name: f.default for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if not isinstance(names.get("name"), str):
        raise TypeError(f"policy class {cls.__qualname__} must be a dataclass with a `name: str = \"...\"` field")
    return names["name"]


def check_policy_class(cls: object) -> str:
    """The name users select a returned policy class by; PluginError when it is not a usable policy."""
    from sparsekv.policies.base import SparsePolicy

    what = getattr(cls, "__qualname__", repr(cls))
    if not inspect.isclass(cls):
        raise PluginError(f"sparsekv_register_policies returned {cls!r}, not a class")
    if not issubclass(cls, SparsePolicy):
        raise PluginError(f"sparsekv_register_policies returned {what}, which is not a SparsePolicy subclass")
    if not dataclasses.is_dataclass(cls) or "__dataclass_fields__" not in vars(cls):
        raise PluginError(f"policy class {what} is not a dataclass; decorate it with @dataclass")
    if "name" not in vars(cls) or not isinstance(vars(cls)["name"], str):
        raise PluginError(f"policy class {what} has no `name` default of its own (it would register as "
                          f"'{policy_name(cls)}'); add `name: str = \"<policy name>\"`")
    try:
        from omegaconf import OmegaConf

        OmegaConf.structured(cls)
    except Exception as exc:  # noqa: BLE001 - OmegaConf's reasons vary (unsupported type, unresolved annotation)
        raise PluginError(f"policy class {what} cannot be a config schema: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0]}") from exc
    return policy_name(cls)


def collect(manager: pluggy.PluginManager, info: PluginInfo) -> tuple[dict[str, type], dict[str, type]]:
    """Call this plugin's own register hooks; (policies by name, models by architecture)."""
    policies: dict[str, type] = {}
    models: dict[str, type] = {}
    for impl in manager.hook.sparsekv_register_policies.get_hookimpls():
        if impl.plugin_name != info.name:
            continue
        returned = impl.function()
        if not isinstance(returned, (list, tuple)):
            raise PluginError(f"sparsekv_register_policies returned {type(returned).__name__}, not a list of "
                              "SparsePolicy subclasses")
        for cls in returned:
            name = check_policy_class(cls)
            if name in policies and policies[name] is not cls:
                raise PluginError(f"registers two policies named '{name}'")
            policies[name] = cls
    for impl in manager.hook.sparsekv_register_models.get_hookimpls():
        if impl.plugin_name != info.name:
            continue
        returned = impl.function()
        if not isinstance(returned, dict) or not all(isinstance(k, str) and inspect.isclass(v)
                                                     for k, v in returned.items()):
            raise PluginError(f"sparsekv_register_models returned {returned!r}, not a dict of "
                              "{architecture name: model class}")
        models.update(returned)
    return policies, models


def entry_points(infos: dict[str, PluginInfo]) -> list[tuple[PluginInfo, importlib.metadata.EntryPoint]]:
    """The installed entry points, minus those left out by SPARSEKV_PLUGINS; two packages that use one entry-point
    name are both skipped (neither can be chosen by name)."""
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        by_name.setdefault(ep.name, []).append(ep)
    allowed = [n.strip() for n in os.environ.get(ALLOW_LIST_ENV, "").split(",") if n.strip()]
    for name in allowed:
        if name not in by_name:
            infos[name] = PluginInfo(name, "?", "?", "failed", f"{ALLOW_LIST_ENV} names '{name}', which no installed "
                                     f"package provides; installed: {', '.join(sorted(by_name)) or 'none'}")
    out = []
    for name, eps in sorted(by_name.items()):
        info = PluginInfo(name, eps[0].dist.name if eps[0].dist else "?", eps[0].value)
        infos[name] = info
        if allowed and name not in allowed:
            info.status = "not allowed"
        elif len({(ep.dist.name if ep.dist else "?", ep.value) for ep in eps}) > 1:
            packages = " and ".join(f"{ep.dist.name if ep.dist else '?'} ({ep.value})" for ep in eps)
            info.package = ", ".join(ep.dist.name if ep.dist else "?" for ep in eps)
            info.status, info.error = "failed", f"entry point name '{name}' is used by {packages}; uninstall one"
        else:
            out.append((info, eps[0]))
    return out


def load_plugin(manager: pluggy.PluginManager, info: PluginInfo, ep: importlib.metadata.EntryPoint):
    try:
        module = ep.load()
        check_hook_names(module)
        manager.register(module, name=info.name)
        return collect(manager, info)
    except Exception as exc:  # noqa: BLE001 - any failure of a third-party plugin skips that plugin only
        if manager.get_plugin(info.name) is not None:
            manager.unregister(name=info.name)
        info.status = "failed"
        info.error = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
        return None


def resolve_collisions(found: dict[str, tuple[PluginInfo, dict, dict]]) -> None:
    """A policy or model name registered twice: a plugin that repeats a built-in's name is skipped, and two
    plugins that share one are both skipped."""
    for kind, index in (("policy", 1), ("model", 2)):
        owners: dict[str, list[PluginInfo]] = {}
        for info, *registered in found.values():
            for name in registered[index - 1]:
                owners.setdefault(name, []).append(info)
        for name, infos in owners.items():
            if len(infos) < 2:
                continue
            builtin = any(i.name == BUILTIN for i in infos)
            for info in infos:
                if info.name == BUILTIN or info.status == "failed":
                    continue
                others = " and ".join(f"package {o.package} ({o.name})" for o in infos if o is not info)
                info.status = "failed"
                info.error = (f"{kind} '{name}' is already registered by {others}"
                              + ("" if builtin else "; set SPARSEKV_PLUGINS to choose one"))


def get_plugin_manager() -> pluggy.PluginManager:
    global _manager, _registry
    if _manager is not None:
        return _manager
    manager = pluggy.PluginManager(ENTRY_POINT_GROUP)
    manager.add_hookspecs(hookspecs)
    manager.register(importlib.import_module("sparsekv.builtin_plugin"), name=BUILTIN)
    infos: dict[str, PluginInfo] = {BUILTIN: PluginInfo(BUILTIN, "sparsekv", "sparsekv.builtin_plugin")}
    found = {BUILTIN: (infos[BUILTIN], *collect(manager, infos[BUILTIN]))}  # a built-in failure is a bug: raise
    if os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("1", "true", "yes"):
        for info, ep in entry_points(infos):
            result = load_plugin(manager, info, ep)
            if result is not None:
                found[info.name] = (info, *result)
    resolve_collisions(found)
    registry = Registry(plugins=infos)
    for info, policies, models in found.values():
        if info.status != "loaded":
            if manager.get_plugin(info.name) is not None:
                manager.unregister(name=info.name)
            continue
        info.policies, info.models = sorted(policies), sorted(models)
        registry.policies.update(policies)
        registry.models.update(models)
    _store_configs(manager, registry)
    for info in infos.values():
        if info.status == "failed":  # once per process, one channel
            warnings.warn(f"sparsekv {info.label} was skipped: {info.error}", RuntimeWarning, stacklevel=2)
    _manager, _registry = manager, registry
    return manager


def _store_configs(manager: pluggy.PluginManager, registry: Registry) -> None:
    from hydra.core.config_store import ConfigStore

    from sparsekv.config import store_schemas

    config_store = ConfigStore.instance()
    before = set(_config_store_entries(config_store.repo))
    for name, cls in registry.policies.items():
        config_store.store(group="policy", name=name, node=cls)
    for impl in manager.hook.sparsekv_register_configs.get_hookimpls():
        info = registry.plugins.get(impl.plugin_name)
        mark = set(_config_store_entries(config_store.repo))
        try:
            impl.function(config_store=config_store)
        except Exception as exc:  # noqa: BLE001 - a failing config hook skips that plugin's configs only
            if info is None or info.name == BUILTIN:
                raise
            _remove_entries(config_store.repo, [e for e in _config_store_entries(config_store.repo)
                                                if e not in mark])
            info.status, info.error = "failed", f"sparsekv_register_configs raised {type(exc).__name__}: {exc}"
            for name in info.policies:
                registry.policies.pop(name, None)
                _remove_entries(config_store.repo, [("policy", f"{name}.yaml")])
            for name in info.models:
                registry.models.pop(name, None)
            manager.unregister(name=info.name)
    store_schemas(config_store, registry.policies)  # after the hooks: per_policy lists the policies that stayed
    _stored_configs.extend(e for e in _config_store_entries(config_store.repo) if e not in before)


def _config_store_entries(repo: dict, prefix: tuple[str, ...] = ()):
    """Paths of the configs (leaves) in ConfigStore's nested {group: {name.yaml: ConfigNode}} repo."""
    for key, value in list(repo.items()):
        if isinstance(value, dict):
            yield from _config_store_entries(value, prefix + (key,))
        else:
            yield prefix + (key,)


def _remove_entries(repo: dict, paths) -> None:
    for path in paths:
        node = repo
        for key in path[:-1]:
            node = node.get(key)
            if not isinstance(node, dict):
                break
        else:
            node.pop(path[-1], None)


def _forget_stored_configs() -> None:
    """Remove the configs this process's manager stored, so a plugin that is no longer loaded no longer
    composes (`policy=<its policy>` fails listing the registered ones)."""
    from hydra.core.config_store import ConfigStore

    _remove_entries(ConfigStore.instance().repo, _stored_configs)
    _stored_configs.clear()


def registry() -> Registry:
    get_plugin_manager()
    assert _registry is not None
    return _registry


def describe() -> str:
    """The loaded, failed and disallowed plugins with their package, entry point and registrations."""
    lines = []
    for info in registry().plugins.values():
        lines.append(f"{info.name}: {info.status} (package {info.package}, entry point {info.module})")
        if info.policies:
            lines.append(f"    policies: {', '.join(info.policies)}")
        if info.models:
            lines.append(f"    models: {', '.join(info.models)}")
        if info.error:
            lines.append(f"    error: {info.error}")
    return "\n".join(lines)


def reset_for_tests() -> None:
    """Forget the loaded plugins and the configs they stored, so the next call rediscovers entry points
    (used by tests)."""
    global _manager, _registry
    _manager = None
    _registry = None
    _forget_stored_configs()
