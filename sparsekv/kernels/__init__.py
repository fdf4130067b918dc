"""Attention kernels: Triton on CUDA (or CPU under TRITON_INTERPRET=1), pure torch elsewhere.

CI runs the tests on CPU with TRITON_INTERPRET=1 exported for the whole pytest process; this
package never touches that variable itself. SPARSEKV_ATTN_BACKEND forces a backend.
"""

from ._dispatch import attention_backend
from .attention import flash_attn_with_lse, flash_attn_with_lse_reference
from .merge import merge_attention_outputs, merge_attention_outputs_reference
from .paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    store_kv,
)

__all__ = [
    "attention_backend",
    "flash_attn_with_lse",
    "flash_attn_with_lse_reference",
    "merge_attention_outputs",
    "merge_attention_outputs_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "store_kv",
]
