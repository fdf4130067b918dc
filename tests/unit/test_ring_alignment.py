"""Ring groups of one size stay disjoint after a load of another size (a gathered selection of an odd count, then a
host list streamed in half-ring groups): the groups in flight hold their own blocks when they are read."""
from __future__ import annotations

import pytest
import torch

from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.kvcache.reader import RingReader

BS, KVH, D = 4, 2, 8


def make_engine(num_slots: int, num_blocks: int = 16) -> OffloadEngine:
    host = HostPool(1, num_blocks, BS, KVH, D, torch.float32, pin_memory=False)
    host.ensure_capacity(num_blocks)
    for block in range(num_blocks):
        k, v = host.block(0, block)
        k.fill_(block)
        v.fill_(-block)
    return OffloadEngine(host, num_slots, 8, 1, torch.device("cpu"))


@pytest.mark.parametrize("num_slots", [4, 5, 8])
@pytest.mark.parametrize("gathered", [1, 2, 3])
def test_groups_read_their_own_blocks_after_a_gather_of_another_size(num_slots, gathered):
    engine = make_engine(num_slots)
    reader = RingReader(engine, 0)
    for group in reader.groups(torch.arange(gathered)):  # leaves the ring's next slot at `gathered`
        assert group.k[::BS, 0, 0].tolist() == group.ids.tolist()
    blocks = list(range(3, 15))
    seen = []
    for group in reader.groups(blocks, group_size=num_slots // 2):
        assert group.k[::BS, 0, 0].tolist() == group.ids  # not overwritten by the group loaded after it
        assert group.v[::BS, 0, 0].tolist() == [-b for b in group.ids]
        seen += group.ids
    assert seen == blocks
