"""RingReader over the OffloadEngine's ring, on CPU: groups come in the order asked, hold the host blocks' KV,
respect the ring's capacity, and a slot is loaded again only after the reader released the group that used it."""
from __future__ import annotations

import pytest
import torch

from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.kvcache.reader import RingReader

BS, KVH, D, LAYERS = 4, 2, 8, 2


class LoggingEngine(OffloadEngine):
    """Logs ('load', slots) when a group is issued or gathered and ('free', slots) when its slots are released."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, range]] = []

    def _issue_group(self, layer: int, blocks: list[int], size: int) -> int:
        first = super()._issue_group(layer, blocks, size)
        self.log.append(("load", range(first, first + len(blocks))))
        return first

    def record_slots_compute_done(self, first: int, count: int) -> None:
        self.log.append(("free", range(first, first + count)))
        super().record_slots_compute_done(first, count)


def make_engine(num_slots: int, num_blocks: int = 12) -> tuple[LoggingEngine, HostPool]:
    host = HostPool(LAYERS, num_blocks, BS, KVH, D, torch.float32, pin_memory=False)
    host.ensure_capacity(num_blocks)
    for layer in range(LAYERS):
        for block in range(num_blocks):
            k, v = host.block(layer, block)
            k.fill_(100 * layer + block)
            v.fill_(-(100 * layer + block))
    return LoggingEngine(host, num_slots, 8, 1, torch.device("cpu")), host


def check_reuse(log: list[tuple[str, range]]) -> None:
    """A slot's load follows the release of its previous group."""
    state: dict[int, str] = {}
    for kind, slots in log:
        for slot in slots:
            if kind == "load":
                assert state.get(slot, "free") == "free", f"slot {slot} reloaded before its group was released: {log}"
            state[slot] = "held" if kind == "load" else "free"


@pytest.mark.parametrize("num_slots, group_size", [(4, None), (4, 1), (4, 4), (3, 2), (1, None)])
def test_groups_in_order_with_their_kv_within_capacity(num_slots, group_size):
    engine, _ = make_engine(num_slots)
    reader = RingReader(engine, layer=1)
    blocks = [9, 2, 3, 4, 11, 0, 7]
    size = group_size or max(1, num_slots // 2)
    seen = []
    for ids, k, v in reader.groups(blocks, group_size):
        assert len(ids) <= size <= reader.ring_capacity
        assert k.shape == v.shape == (len(ids) * BS, KVH, D)
        expected = torch.tensor([100 + b for b in ids], dtype=torch.float32).repeat_interleave(BS)
        assert torch.equal(k[:, 0, 0], expected) and torch.equal(v[:, 0, 0], -expected)
        seen.extend(ids)
    assert seen == blocks
    assert reader.num_groups(len(blocks), group_size) == -(-len(blocks) // size)
    check_reuse(engine.log)
    assert sum(len(s) for kind, s in engine.log if kind == "load") == len(blocks) == engine.transfer_stats["h2d_blocks"]


def test_slots_are_released_only_when_the_reader_advances():
    engine, _ = make_engine(2)
    groups = RingReader(engine, layer=0).groups([1, 2, 3], group_size=1)
    first = next(groups)
    assert first.ids == [1]
    # block 1 is held in slot 0 while the caller reads it; block 2 loads ahead into slot 1
    assert engine.log == [("load", range(0, 1)), ("load", range(1, 2))]
    second = next(groups)
    assert second.ids == [2]
    # advancing released slot 0, and only then did block 3 load into it
    assert engine.log[2:] == [("free", range(0, 1)), ("load", range(0, 1))]
    groups.close()  # a caller that stops early still releases the group it held
    assert engine.log[-1] == ("free", range(1, 2))
    check_reuse(engine.log)


def test_device_tensor_selection_is_gathered_in_order():
    engine, _ = make_engine(3)
    chosen = torch.tensor([5, 1, 8, 2, 10])
    seen = []
    for ids, k, _ in RingReader(engine, layer=1).groups(chosen):
        assert isinstance(ids, torch.Tensor) and len(ids) <= 3
        assert torch.equal(k[::BS, 0, 0], (100 + ids).float())
        seen.extend(ids.tolist())
    assert seen == chosen.tolist()


def test_group_size_beyond_the_ring_is_refused():
    engine, _ = make_engine(2)
    with pytest.raises(ValueError, match="group_size=3: must be between 1 and the ring's 2 slots"):
        list(RingReader(engine, layer=0).groups([1, 2, 3], group_size=3))
