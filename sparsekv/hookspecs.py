"""The sparsekv plugin API: every hook a plugin may implement.

A plugin is a module with functions marked `@sparsekv.hookimpl`. Third-party packages expose it through
the entry-point group `sparsekv` in their pyproject.toml:

    [project.entry-points.sparsekv]
    my_plugin = "my_package.plugin_module"

Built-in models and policies are registered through these same hooks (sparsekv.builtin_plugin).
Plugins load once per process, before Hydra composes the config (sparsekv.plugins.get_plugin_manager).
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
    """Return SparsePolicy subclasses. Each is a dataclass whose fields are its hyperparameters and whose
    `name` field default is the name users select with `policy=<name>`."""


@hookspec
def sparsekv_register_configs(config_store) -> None:
    """Store extra Hydra configs (e.g. `config_store.store(group="model", name="my_model", node={...})`)."""
