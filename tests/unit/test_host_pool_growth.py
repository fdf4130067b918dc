"""The host KV pool grows in slabs with the blocks in use and gives them back when the store goes idle: blocks in
use and host bytes return to where they started after every request, finished, aborted or preempted."""
from __future__ import annotations

import functools

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.kvcache.host_pool import HostPool
from tests.conftest import random_prompt

CPU = ["device=cpu", "dtype=float32", "graph=eager"]
BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4  # tiny checkpoint, 16-token blocks: K and V of every layer
SLAB_BLOCKS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_slabs_grow_on_demand_and_release_down_to_what_is_kept():
    pool = HostPool(2, 100, 4, 1, 8, torch.float32, pin_memory=False, slab_bytes=3 * 2 * 4 * 8 * 4)
    assert pool.blocks_per_slab == 3 and pool.bytes_allocated == 0 and pool.capacity == 0
    pool.ensure_capacity(4)
    assert pool.capacity == 6 and pool.bytes_allocated == 6 * pool.bytes_per_block
    generation = pool.generation
    pool.ensure_capacity(7)
    assert pool.capacity == 9 and pool.generation > generation
    pool.release_slabs(keep_blocks=4)
    assert pool.capacity == 6 and pool.bytes_allocated == 6 * pool.bytes_per_block
    pool.release_slabs()
    assert pool.capacity == 0 and pool.bytes_allocated == 0
    with pytest.raises(ValueError, match="holds 100 blocks, 101 requested"):
        pool.ensure_capacity(101)


def small_slab_llm(path, monkeypatch, *extra: str) -> LLM:
    monkeypatch.setattr("sparsekv.kvcache.offload_store.HostPool",
                        functools.partial(HostPool, slab_bytes=SLAB_BLOCKS * BLOCK_BYTES // 2))
    return LLM(str(path), overrides=CPU + ["offload=cpu", "offload.block_size=16", "offload.num_gpu_blocks=2",
                                           "offload.prefill_chunk_size=32", *extra])


def pool_counters(llm: LLM) -> tuple[int, int]:
    engine = llm.engine
    return engine.block_manager.num_free_blocks, engine.kv_store.host.bytes_allocated


@pytest.mark.parametrize("cache", ["offload.gpu_cache_gib=0", "offload.gpu_cache_gib=0.001"])
def test_counters_return_to_start_after_finished_aborted_and_preempted_requests(qwen3_ckpt, monkeypatch, cache):
    blocks = 9  # four prompts need 17 blocks together: the newest sequences are preempted
    llm = small_slab_llm(qwen3_ckpt, monkeypatch, cache,
                         "offload.host_pool_gib=%.12f" % ((blocks + 0.5) * BLOCK_BYTES / 2**30))
    engine = llm.engine
    start = pool_counters(llm)
    assert start == (blocks, 0)  # nothing pinned before the first request

    prompts = [random_prompt(n, seed=n) for n in (75, 33, 9, 48)]
    preempted = []
    original = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
    grown = []
    first = llm.generate(prompts, GREEDY, progress=lambda e: grown.append(e.kv_store.host.bytes_allocated))
    assert preempted and max(grown) > 0
    assert max(grown) <= -(-blocks // SLAB_BLOCKS) * SLAB_BLOCKS * BLOCK_BYTES  # only slabs that were used
    assert pool_counters(llm) == start

    seq = engine.add_request(prompts[0], GREEDY)
    engine.step()  # prefill
    engine.step()  # a decode step
    assert pool_counters(llm) != start
    engine.abort(seq)
    assert pool_counters(llm) == start

    # the same requests on the regrown pool: the same tokens (slab addresses and cached blocks were refreshed)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in first]
    assert pool_counters(llm) == start


def test_reserved_blocks_stay_pinned_while_idle(qwen3_ckpt, monkeypatch):
    llm = small_slab_llm(qwen3_ckpt, monkeypatch, "offload.host_pool_gib=0.05")
    store = llm.engine.kv_store
    store.reserve(5 * 16)  # 5 blocks: 3 slabs
    kept = store.host.bytes_allocated
    assert kept == 3 * SLAB_BLOCKS * BLOCK_BYTES
    llm.generate([random_prompt(150, seed=1)], GREEDY)  # 10 blocks
    assert store.host.bytes_allocated == kept


def test_reserve_tokens_pins_at_build_and_keeps_it_while_idle(qwen3_ckpt, monkeypatch):
    llm = small_slab_llm(qwen3_ckpt, monkeypatch, "offload.host_pool_gib=0.05", "offload.reserve_tokens=80")
    store = llm.engine.kv_store
    assert store.host.bytes_allocated == 3 * SLAB_BLOCKS * BLOCK_BYTES  # 5 blocks of 16 tokens: 3 slabs
    llm.generate([random_prompt(150, seed=1)], GREEDY)
    assert store.host.bytes_allocated == 3 * SLAB_BLOCKS * BLOCK_BYTES


def test_reserve_tokens_beyond_the_pool_fail_before_the_weights_load(qwen3_ckpt, monkeypatch):
    pool = "offload.host_pool_gib=%.12f" % (9.5 * BLOCK_BYTES / 2**30)  # 9 blocks: 144 tokens
    monkeypatch.setattr("sparsekv.factory.build_model", lambda *a, **k: pytest.fail("weights built"))
    with pytest.raises(ValueError, match=r"offload.reserve_tokens=200 exceeds the host KV pool's 144 tokens; lower it "
                                         r"or raise offload.host_pool_gib"):
        small_slab_llm(qwen3_ckpt, monkeypatch, pool, "offload.reserve_tokens=200")


def test_tasks_reserve_their_largest_batch_in_whole_blocks():
    from sparsekv.tasks.common import reserve_largest_batch

    class Engine:
        def __init__(self):
            self.reserved: list[int] = []

        def reserve(self, tokens: int) -> float:
            self.reserved.append(tokens)
            return 0.5

    engine = Engine()
    assert reserve_largest_batch(engine, [[10, 20], [17, 1, 1], [40]], 16) == 0.5
    assert engine.reserved == [64]  # [17, 1, 1] holds 32 + 16 + 16 tokens of blocks; [40] 48; [10, 20] 16 + 32
    assert reserve_largest_batch(engine, [], 16) == 0.0 and engine.reserved == [64]
