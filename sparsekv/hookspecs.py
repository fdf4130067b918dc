"""The sparsekv plugin API: every hook a plugin may implement.

A plugin is a module with functions marked `@sparsekv.hookimpl`. Third-party packages expose it through
the entry-point group `sparsekv` in their pyproject.toml:

    [project.entry-points.sparsekv]
    my_plugin = "my_package.plugin_module"

Built-in models and policies are registered through these same hooks (sparsekv.builtin_plugin).
Plugins load once per process, before Hydra composes the config (sparsekv.plugins.get_plugin_manager), each in
isolation: a plugin that fails to import, whose hook raises or returns the wrong type, that defines a
`sparsekv_*` function which is not one of the hooks below (or lacks @sparsekv.hookimpl), or that registers a
policy or model name another package registers, is skipped with one warning naming its package and entry point.
`SPARSEKV_PLUGINS=a,b` loads only those entry points; `SPARSEKV_DISABLE_PLUGIN_AUTOLOAD=1` loads none;
`python -m sparsekv task=plugins` lists what loaded, what failed and why.
"""
from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("sparsekv")
hookimpl = pluggy.HookimplMarker("sparsekv")


@hookspec
def sparsekv_register_models() -> dict[str, type]:
    """Return {HF architecture name: model class}, e.g. {"Qwen3ForCausalLM": Qwen3ForCausalLM}.

    The class is built as `cls(spec: ModelSpec)` and follows sparsekv.models.base.CausalLM.
    """


@hookspec
def sparsekv_register_policies() -> list[type]:
    """Return a list of SparsePolicy subclasses. Each is a dataclass whose fields are its hyperparameters and which
    declares its own `name` default, the name users select with `policy=<name>`. Range checks belong in
    __post_init__: raise sparsekv.PolicyConfigError (or ValueError) naming the field and the fix."""


@hookspec
def sparsekv_register_configs(config_store) -> None:
    """Store extra Hydra configs (e.g. `config_store.store(group="model", name="my_model", node={...})`)."""
