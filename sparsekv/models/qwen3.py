from __future__ import annotations

from sparsekv.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 = the Llama decoder with RMSNorm on each head's queries and keys before rotary."""
    qk_norm = True
