"""The zero-copy block gather (sparsekv/kernels/block_gather.py) against its reference, and
OffloadEngine.gather_block_groups: the path a device-side block choice (Quest) loads through.

On CPU the kernel runs under the Triton interpreter (the triton_kernels fixture); on the GPU host the slabs are
pinned and the kernel reads them over PCIe."""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import block_gather
from sparsekv.kernels.block_gather import (gather_host_blocks, gather_host_blocks_reference, gather_missing_blocks,
                                           gather_missing_blocks_reference, slab_word_offsets)
from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.offload_engine import OffloadEngine

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _slabs(num_slabs: int, layers: int, per_slab: int, block: tuple[int, ...], dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    pin = DEV.type == "cuda"

    def one():
        return torch.randn(layers, per_slab, *block, generator=g).to(dtype).pin_memory() if pin else \
            torch.randn(layers, per_slab, *block, generator=g).to(dtype)
    return [one() for _ in range(num_slabs)], [one() for _ in range(num_slabs)]


@pytest.mark.parametrize("dtype,block,ids,layer,first", [
    (torch.bfloat16, (8, 2, 16), [0, 7, 14, 3, 11], 2, 1),
    (torch.float32, (4, 1, 8), [5], 0, 0),
    (torch.float16, (16, 2, 32), [9, 1, 2, 13], 1, 4),
])
def test_kernel_matches_reference(dtype, block, ids, layer, first, triton_kernels, monkeypatch):
    calls = []
    kernel = block_gather._gather_kernel
    monkeypatch.setattr(block_gather, "_gather_kernel",
                        type("Spy", (), {"__getitem__": lambda _, grid: (calls.append(grid), kernel[grid])[1]})())
    k_slabs, v_slabs = _slabs(3, 3, 5, block, dtype, seed=len(ids))
    offsets = torch.tensor(slab_word_offsets(k_slabs, v_slabs), dtype=torch.int64, device=DEV)
    block_ids = torch.tensor(ids, dtype=torch.int64, device=DEV)
    dst = torch.full((2, 8, *block), float("nan"), dtype=dtype, device=DEV)
    ref = dst.clone()
    gather_host_blocks(dst, (k_slabs, v_slabs), offsets, block_ids, layer, first, kernels=triton_kernels)
    assert calls, "the Triton kernel did not run"
    gather_host_blocks_reference(ref, (k_slabs, v_slabs), block_ids, layer, first)
    assert torch.equal(dst[:, first:first + len(ids)], ref[:, first:first + len(ids)])
    for i, b in enumerate(ids):  # the reference itself reads the right host block
        slab, index = divmod(b, 5)
        assert torch.equal(dst[1, first + i].cpu(), v_slabs[slab][layer, index])
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[first:first + len(ids)] = False
    assert torch.isnan(dst[:, untouched].float()).all()  # no slot outside the group was written


@pytest.mark.parametrize("dtype,block", [(torch.bfloat16, (8, 2, 16)), (torch.float32, (3,))])
def test_missing_kernel_matches_reference(dtype, block, triton_kernels, monkeypatch):
    """Behind a block -> slot table: hits are not copied (their table entry is their slot), misses land in their
    staging slot, padding (-1, or past the table) is neither copied nor counted; counts add up over calls."""
    calls = []
    kernel = block_gather._gather_missing_kernel
    monkeypatch.setattr(block_gather, "_gather_missing_kernel",
                        type("Spy", (), {"__getitem__": lambda _, grid: (calls.append(grid), kernel[grid])[1]})())
    k_slabs, v_slabs = _slabs(3, 2, 5, block, dtype, seed=7)
    offsets = torch.tensor(slab_word_offsets(k_slabs, v_slabs), dtype=torch.int64, device=DEV)
    lut = torch.full((15,), -1, dtype=torch.int64, device=DEV)
    lut[[2, 9, 13]] = torch.tensor([5, 0, 3], device=DEV)  # cached blocks and their slots
    ids = torch.tensor([9, 4, -1, 13, 11, 2, 14, 15], dtype=torch.int64, device=DEV)  # 15: past the table
    staging = torch.tensor([8, 9, 10, 11, 12, 13, 14, 1], dtype=torch.int64, device=DEV)
    dst = torch.full((2, 16, *block), float("nan"), dtype=dtype, device=DEV)
    ref = dst.clone()
    table = torch.full((8,), -7, dtype=torch.int64, device=DEV)
    ref_table = table.clone()
    counts = torch.tensor([1, 2], dtype=torch.int64, device=DEV)
    ref_counts = counts.clone()
    gather_missing_blocks(dst, (k_slabs, v_slabs), offsets, ids, lut, staging, 1, table, counts,
                          kernels=triton_kernels)
    assert calls, "the Triton kernel did not run"
    gather_missing_blocks_reference(ref, (k_slabs, v_slabs), ids, lut, staging, 1, ref_table, ref_counts)
    assert torch.equal(table, ref_table) and torch.equal(counts, ref_counts)
    assert table.tolist() == [0, 9, 10, 3, 12, 5, 14, 1]
    assert counts.tolist() == [1 + 3, 2 + 3]  # hits 9, 13, 2; misses 4, 11, 14
    assert torch.equal(dst.nan_to_num(0.5), ref.nan_to_num(0.5))
    for slot, b in ((9, 4), (12, 11), (14, 14)):
        slab, index = divmod(b, 5)
        assert torch.equal(dst[0, slot].cpu(), k_slabs[slab][1, index])
        assert torch.equal(dst[1, slot].cpu(), v_slabs[slab][1, index])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[9, 12, 14]] = False
    assert torch.isnan(dst[:, untouched].float()).all()  # hits, padding and other slots are not written


def test_missing_gather_refuses_bad_tables():
    k_slabs, v_slabs = _slabs(1, 2, 4, (4, 1, 8), torch.float32, seed=0)
    ids = torch.tensor([1, 2], dtype=torch.int64, device=DEV)
    lut = torch.tensor([-1, -1, 0], dtype=torch.int64, device=DEV)
    dst = torch.zeros((2, 3, 4, 1, 8), device=DEV)
    with pytest.raises(ValueError, match=r"expected staging \[2\] int64"):
        gather_missing_blocks(dst, (k_slabs, v_slabs), None, ids, lut, ids[:1], 0)
    with pytest.raises(ValueError, match=r"expected slot_of_block \[m\] int64"):
        gather_missing_blocks(dst, (k_slabs, v_slabs), None, ids, lut.int(), ids, 0)
    with pytest.raises(ValueError, match=r"expected counts \[2\] int64"):
        gather_missing_blocks(dst, (k_slabs, v_slabs), None, ids, lut, ids, 0, counts=lut)


def test_bad_input_is_refused():
    k_slabs, v_slabs = _slabs(1, 2, 4, (4, 1, 8), torch.float32, seed=0)
    ids = torch.tensor([1, 2], dtype=torch.int64, device=DEV)
    dst = torch.zeros((2, 3, 4, 1, 8), device=DEV)
    with pytest.raises(ValueError, match=r"expected dst \[2, slots, 4, 1, 8\]"):
        gather_host_blocks(dst[0], (k_slabs, v_slabs), None, ids, 0, 0)
    with pytest.raises(ValueError, match="int64"):
        gather_host_blocks(dst, (k_slabs, v_slabs), None, ids.int(), 0, 0)
    with pytest.raises(ValueError, match=r"slots \[2, 4\) do not fit the 3 slots"):
        gather_host_blocks(dst, (k_slabs, v_slabs), None, ids, 0, 2)
    with pytest.raises(ValueError, match="dtype"):
        gather_host_blocks(dst.half(), (k_slabs, v_slabs), None, ids, 0, 0)


@pytest.mark.usefixtures("triton_kernels")
def test_engine_gathers_groups_through_the_ring():
    """More chosen blocks than slots: groups of at most num_slots, each holding exactly the chosen host blocks,
    across slab boundaries, with the bytes counted."""
    layers, block_size, kvh, dim = 2, 4, 2, 8
    host = HostPool(layers, 40, block_size, kvh, dim, torch.bfloat16, pin_memory=DEV.type == "cuda",
                    slab_bytes=3 * block_size * kvh * dim * 2 * layers)  # 3 blocks per slab
    host.ensure_capacity(12)
    assert host.blocks_per_slab == 3 and len(host.k_slabs) == 4
    for slab in host.k_slabs + host.v_slabs:
        slab.copy_(torch.randn(slab.shape).to(slab.dtype))
    engine = OffloadEngine(host, num_gpu_blocks=3, prefill_tokens=8, max_num_seqs=1, device=DEV)
    chosen = [11, 0, 5, 6, 2, 9, 4]
    seen = []
    for first, group in engine.gather_block_groups(1, torch.tensor(chosen, device=DEV)):
        assert len(group) <= 3
        k, v = engine.get_kv_for_slots(first, len(group))  # [n * block_size, KVH, D]
        for i, block in enumerate(group.tolist()):
            host_k, host_v = host.block(1, block)
            assert torch.equal(k[i * block_size:(i + 1) * block_size].cpu(), host_k)
            assert torch.equal(v[i * block_size:(i + 1) * block_size].cpu(), host_v)
            seen.append(block)
        engine.record_slots_compute_done(first, len(group))
    assert seen == chosen
    assert engine.transfer_stats["h2d_blocks"] == len(chosen)
    assert engine.transfer_stats["h2d_bytes"] == 2 * len(chosen) * block_size * kvh * dim * 2


@pytest.mark.usefixtures("triton_kernels")
def test_engine_resolves_choices_against_the_cache_and_learns_them():
    """resolve_selected: cached choices are read where they are, missing ones staged from the host, both counted on
    the device; an eager call then moves the missing ones from staging into the cache, so the same choice next step
    is all hits."""
    layers, block_size, kvh, dim = 2, 4, 2, 8
    host = HostPool(layers, 40, block_size, kvh, dim, torch.bfloat16, pin_memory=DEV.type == "cuda",
                    slab_bytes=3 * block_size * kvh * dim * 2 * layers)  # 3 blocks per slab
    host.ensure_capacity(12)
    for slab in host.k_slabs + host.v_slabs:
        slab.copy_(torch.randn(slab.shape).to(slab.dtype))
    engine = OffloadEngine(host, num_gpu_blocks=2, prefill_tokens=8, max_num_seqs=1, device=DEV,
                           cache_slots_per_layer=10)
    cache = engine.cache
    engine.begin_step()
    engine.cache_slots(1, [3, 4])  # cached before: 3 and 4
    chosen = torch.tensor([4, 10, -1, 3, 7], device=DEV)  # -1: a padded row entry

    def read(table):
        for i, block in enumerate(chosen.tolist()):
            if block >= 0:
                host_k, host_v = host.block(1, block)
                assert torch.equal(cache.k[table[i]].cpu(), host_k) and torch.equal(cache.v[table[i]].cpu(), host_v)

    engine.begin_step()
    table = engine.resolve_selected(1, chosen, 12).tolist()
    read(table)
    assert table[0] == cache.slot_of[1].get(4) is not None and table[3] == cache.slot_of[1][3]
    staged = cache.staging[1]
    assert len(staged) == 5 and table[1] in staged and table[4] in staged
    stats = engine.cache_stats
    assert (stats["cache_hit_blocks"], stats["cache_miss_blocks"]) == (2 + 0, 2 + 2)  # lookup's 2 misses, then 2
    assert {10, 7} <= set(cache.slot_of[1])  # learnt: moved into the cache by the eager call
    assert engine.transfer_stats["h2d_blocks"] == 2 + 2  # from their staging slots: no second trip over PCIe
    for capturing in (True, False):  # the capture that follows the eager step, then a later eager step
        engine.begin_step()
        if capturing:  # a capture makes no device list: the eager step made the learnt cache's table already
            engine.start_capture(type("Capture", (), {"moved": {}, "fork_event": lambda self, stream: None})())
        try:
            table = engine.resolve_selected(1, chosen, 12).tolist()
        finally:
            engine.finish_capture() if capturing else None
        read(table)
        assert not {slot for slot, block in zip(table, chosen.tolist()) if block >= 0} & set(staged)  # in place
    assert engine.cache_stats["cache_hit_blocks"] == 2 + 4 + 4


@pytest.mark.gpu
def test_gpu_real_size_gather_is_exact_and_never_syncs():
    """Qwen3-4B block layout (1024 tokens, 8 KV heads, D=128, bf16) in pinned slabs: the kernel reads the pinned
    pages over PCIe, bit-exact, and queueing it waits for nothing on the host."""
    layers, block_size, kvh, dim = 4, 1024, 8, 128
    host = HostPool(layers, 64, block_size, kvh, dim, torch.bfloat16, pin_memory=True, slab_bytes=1 << 26)
    host.ensure_capacity(40)
    assert len(host.k_slabs) > 2
    for slab in host.k_slabs + host.v_slabs:
        slab.copy_(torch.randn(slab.shape).to(slab.dtype))
    engine = OffloadEngine(host, num_gpu_blocks=4, prefill_tokens=1024, max_num_seqs=1, device=DEV)
    chosen = torch.tensor([0, 39, 17, 8, 30, 3], device=DEV)
    engine._device_slab_offsets()  # built once when the pool grows (a host copy), not per step
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(2)  # error on any synchronising call
    copies = []
    try:
        for first, group in engine.gather_block_groups(3, chosen):  # a later group may reuse these slots
            k, v = engine.get_kv_for_slots(first, len(group))
            copies.append((group, k.clone(), v.clone()))
            engine.record_slots_compute_done(first, len(group))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    seen = []
    for group, k, v in copies:
        for i, block in enumerate(group.tolist()):
            host_k, host_v = host.block(3, block)
            assert torch.equal(k[i * block_size:(i + 1) * block_size].cpu(), host_k)
            assert torch.equal(v[i * block_size:(i + 1) * block_size].cpu(), host_v)
            seen.append(block)
    assert seen == chosen.tolist()


@pytest.mark.gpu
def test_gpu_real_size_missing_gather_is_exact_and_never_syncs():
    """Llama-3.1-8B fp8 block layout (256 tokens, 8 KV heads, D=128) in pinned slabs behind a cache table: misses
    read over PCIe bit-exact into their staging slots, hits untouched, no host sync."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layers, per_slab, block = 2, 16, (256, 8, 128)
    k_slabs, v_slabs = _slabs(3, layers, per_slab, block, torch.float8_e4m3fn, seed=3)
    offsets = torch.tensor(slab_word_offsets(k_slabs, v_slabs), dtype=torch.int64, device=DEV)
    g = torch.Generator().manual_seed(4)
    lut = torch.full((48,), -1, dtype=torch.int64)
    cached = torch.randperm(48, generator=g)[:20]
    lut[cached] = torch.randperm(32, generator=g)[:20]
    ids = torch.randperm(48, generator=g)[:24].to(DEV)
    staging = torch.arange(32, 56, dtype=torch.int64, device=DEV)
    lut = lut.to(DEV)
    dst = torch.zeros((2, 56, *block), dtype=torch.float8_e4m3fn, device=DEV)
    table = torch.empty(24, dtype=torch.int64, device=DEV)
    counts = torch.zeros(2, dtype=torch.int64, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(2)  # error on any synchronising call
    try:
        gather_missing_blocks(dst, (k_slabs, v_slabs), offsets, ids, lut, staging, 1, table, counts)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = torch.zeros_like(dst)
    ref_table, ref_counts = torch.empty_like(table), torch.zeros_like(counts)
    gather_missing_blocks_reference(ref, (k_slabs, v_slabs), ids, lut, staging, 1, ref_table, ref_counts)
    assert torch.equal(dst.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(table, ref_table) and torch.equal(counts, ref_counts)
    assert counts.sum().item() == 24 and counts[1].item() > 0
