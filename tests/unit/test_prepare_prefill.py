"""ModelRunner.prepare_prefill packs a prefill step: each sequence's new tokens in row order, their positions, their
KV slots through the block table, one chunk per sequence, and the rows to sample (a sequence whose chunk ends its
prompt)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from sparsekv.engine.model_runner import ModelRunner
from sparsekv.engine.scheduler import ScheduledBatch
from sparsekv.engine.sequence import Sequence
from sparsekv.sampling_params import SamplingParams

BLOCK = 4


def sequence(tokens: list[int], table: list[int], computed: int) -> Sequence:
    seq = Sequence(tokens, SamplingParams(), BLOCK)
    seq.block_table, seq.num_computed_tokens = table, computed
    return seq


def test_two_sequences_one_continuing():
    runner = ModelRunner(model=None, kv_store=SimpleNamespace(block_size=BLOCK), device=torch.device("cpu"))
    first = sequence(list(range(100, 111)), [7, 2, 9], computed=5)  # tokens 5..10 now: the prompt's end
    second = sequence(list(range(200, 209)), [3, 4, 5], computed=0)  # tokens 0..5 now: a chunk, not the end
    ids, positions, context, sample_rows = runner.prepare_prefill(ScheduledBatch([first, second], [6, 6], True))
    assert ids.tolist() == list(range(105, 111)) + list(range(200, 206))
    assert positions.tolist() == [5, 6, 7, 8, 9, 10, 0, 1, 2, 3, 4, 5]
    slot = lambda table, p: table[p // BLOCK] * BLOCK + p % BLOCK  # noqa: E731
    expected = [slot([7, 2, 9], p) for p in range(5, 11)] + [slot([3, 4, 5], p) for p in range(6)]
    assert context.slot_mapping.tolist() == expected and context.slot_mapping.dtype == torch.int64
    assert [(c.start, c.end, c.num_cached, c.first_block) for c in context.chunks] == [(0, 6, 5, None), (6, 12, 0, 3)]
    assert [c.block_table.tolist() for c in context.chunks] == [[7, 2, 9], [3, 4, 5]]
    assert sample_rows == [5]
    assert ids.dtype == positions.dtype == torch.int64
