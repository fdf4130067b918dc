"""Built-in models and policies, registered through the same hooks as third-party plugins."""
from __future__ import annotations

from sparsekv.hookspecs import hookimpl


@hookimpl
def sparsekv_register_models() -> dict[str, type]:
    from sparsekv.models.llama import LlamaForCausalLM
    from sparsekv.models.qwen3 import Qwen3ForCausalLM

    return {"Qwen3ForCausalLM": Qwen3ForCausalLM, "LlamaForCausalLM": LlamaForCausalLM}


@hookimpl
def sparsekv_register_policies() -> list[type]:
    from sparsekv.policies.full import FullAttentionPolicy

    return [FullAttentionPolicy]
