"""Built-in models and policies, registered through the same hooks as third-party plugins."""
from __future__ import annotations

import importlib

from sparsekv.hookspecs import hookimpl

MODEL_CLASSES = {
    "Qwen3ForCausalLM": "sparsekv.models.qwen3:Qwen3ForCausalLM",
    "LlamaForCausalLM": "sparsekv.models.llama:LlamaForCausalLM",
}
POLICY_CLASSES = [
    "sparsekv.policies.full:FullAttentionPolicy",
    "sparsekv.policies.minference:MInferencePolicy",
    "sparsekv.policies.quest:QuestPolicy",
    "sparsekv.policies.xattn:XAttentionPolicy",
]


def load(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@hookimpl
def sparsekv_register_models() -> dict[str, type]:
    return {arch: load(path) for arch, path in MODEL_CLASSES.items()}


@hookimpl
def sparsekv_register_policies() -> list[type]:
    return [load(path) for path in POLICY_CLASSES]
