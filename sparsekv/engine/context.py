"""Per-step metadata shared by the model's attention layers and the KV store."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sparsekv.engine.sequence import Sequence


@dataclass
class PrefillChunk:
    """One sequence's rows in a packed prefill step."""
    seq: Sequence
    start: int  # first row in the packed q/k/v
    end: int  # one past the last row
    num_cached: int  # tokens whose KV was stored before this step
    block_table: torch.Tensor  # [num_blocks] int32 on the device
    first_block: int | None = None  # when the sequence's blocks are one ascending run of ids: the first one

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class Context:
    is_prefill: bool
    kv_store: Any
    seqs: list[Sequence]
    slot_mapping: torch.Tensor | None = None  # [N] int64: block_id * block_size + offset (paged store)
    chunks: list[PrefillChunk] = field(default_factory=list)  # prefill only
    block_tables: torch.Tensor | None = None  # decode: [B, max_blocks] int32
    context_lens: torch.Tensor | None = None  # decode: [B] int32, including the new token
    max_context_len: int = 0  # decode: host copy of context_lens.max()


_CONTEXT: Context | None = None


def set_context(context: Context | None) -> None:
    global _CONTEXT
    _CONTEXT = context


def get_context() -> Context:
    if _CONTEXT is None:
        raise RuntimeError("attention ran outside a model-runner step: no Context is set")
    return _CONTEXT
