"""The module named by the `sparsekv` entry point: hook implementations only."""
from __future__ import annotations

import sparsekv

from sparsekv_streamingllm.policy import StreamingLLMPolicy


@sparsekv.hookimpl
def sparsekv_register_policies() -> list[type]:
    return [StreamingLLMPolicy]
