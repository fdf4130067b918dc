"""Attention kernels: Triton on CUDA (or CPU under TRITON_INTERPRET=1), pure torch elsewhere.

The run's kernels are resolved once, when the engine is built (backend.resolve_kernels -> KernelChoice).
CI runs the tests on CPU with TRITON_INTERPRET=1 exported for the whole pytest process; this package never
touches that variable itself.
"""

from .attention import flash_attn_with_lse, flash_attn_with_lse_reference
from .backend import KernelChoice, resolve_kernels
from .merge import merge_attention_outputs, merge_attention_outputs_reference
from .paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    store_kv,
)

__all__ = [
    "KernelChoice",
    "flash_attn_with_lse",
    "flash_attn_with_lse_reference",
    "merge_attention_outputs",
    "merge_attention_outputs_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "resolve_kernels",
    "store_kv",
]
