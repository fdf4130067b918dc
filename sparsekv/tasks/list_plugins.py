"""task=plugins: the loaded, failed and disallowed plugins, their package, entry point and registrations.

    python -m sparsekv task=plugins
    SPARSEKV_PLUGINS=streamingllm python -m sparsekv task=plugins     # only the named entry points load
"""
from __future__ import annotations

from omegaconf import DictConfig

from sparsekv import plugins


def run(cfg: DictConfig) -> dict:
    print(plugins.describe())
    return {name: {"status": p.status, "package": p.package, "entry_point": p.module, "policies": p.policies,
                   "models": p.models, "error": p.error} for name, p in plugins.registry().plugins.items()}
