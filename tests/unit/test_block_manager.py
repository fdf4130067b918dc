"""BlockManager: block counts per sequence, lowest free ids first, exhaustion, and blocks coming back."""
from __future__ import annotations

import pytest

from sparsekv.engine.block_manager import BlockManager
from sparsekv.engine.sequence import Sequence
from sparsekv.sampling_params import SamplingParams

BLOCK = 4


def seq(num_tokens: int) -> Sequence:
    return Sequence(list(range(num_tokens)), SamplingParams(max_tokens=8), block_size=BLOCK)


def test_allocate_takes_ceil_tokens_over_block_size_lowest_ids_first():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    a, b = seq(5), seq(4)
    manager.allocate(a, len(a))
    manager.allocate(b, len(b))
    assert a.block_table == [0, 1]
    assert b.block_table == [2]
    assert manager.num_free_blocks == 5
    assert manager.high_water == 3


def test_allocate_adds_only_the_missing_blocks_as_a_sequence_grows():
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    s = seq(4)
    manager.allocate(s, 4)
    manager.allocate(s, 4)  # already holds them
    assert s.block_table == [0]
    manager.allocate(s, 5)
    assert s.block_table == [0, 1]
    assert manager.num_free_blocks == 2


@pytest.mark.parametrize("tokens,expected", [(12, True), (13, False), (0, True)])
def test_can_allocate_counts_blocks_against_the_free_ones(tokens, expected):
    manager = BlockManager(num_blocks=3, block_size=BLOCK)
    assert manager.can_allocate(seq(max(tokens, 1)), tokens) is expected


def test_can_allocate_counts_the_blocks_a_sequence_already_holds():
    manager = BlockManager(num_blocks=3, block_size=BLOCK)
    s = seq(8)
    manager.allocate(s, 8)
    assert manager.num_free_blocks == 1
    assert manager.can_allocate(s, 12)  # one more block
    assert not manager.can_allocate(s, 13)  # two more


def test_allocate_beyond_the_pool_fails_and_changes_nothing():
    manager = BlockManager(num_blocks=2, block_size=BLOCK)
    s = seq(9)
    with pytest.raises(RuntimeError, match="out of KV blocks: need 3, 2 free"):
        manager.allocate(s, 9)
    assert s.block_table == []
    assert manager.num_free_blocks == 2


def test_deallocate_returns_blocks_and_resets_the_computed_count():
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    a, b = seq(8), seq(4)
    manager.allocate(a, 8)
    manager.allocate(b, 4)
    a.num_computed_tokens = 8
    manager.deallocate(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert manager.num_free_blocks == 3
    c = seq(4)
    manager.allocate(c, 4)
    assert c.block_table == [0]  # the lowest freed id is reused first
    assert manager.high_water == 3
