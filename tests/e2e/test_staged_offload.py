"""Offloaded decode of a batch without a GPU block cache that holds it (float32, CPU): the whole batch goes through
the ring with one reader call per layer (sparsekv/kvcache/staged_decode.py) and gives the tokens of GPU-resident
decode and of the cache path, for sequences of different lengths, full attention and Quest."""
from __future__ import annotations

import pytest

from sparsekv import LLM, SamplingParams
from sparsekv.graphs.cuda_graph import attach_graph_runner
from sparsekv.kvcache import staged_decode
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.kvcache.offload_store import OffloadKVStore
from tests.conftest import random_prompt

CPU = ["device=cpu", "dtype=float32", "graph=eager"]
OFFLOAD = ["offload=cpu", "offload.host_pool_gib=0.05", "offload.block_size=16", "offload.num_gpu_blocks=4",
           "offload.prefill_chunk_size=32"]
QUEST = ["policy=quest", "policy.topk_blocks=2", "policy.dense_layers=1", "policy.token_budget=null"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LENGTHS = (90, 7, 41, 130, 16, 64, 33, 100)  # 0 to 8 full blocks, partial and whole tails
BATCHES = {1: LENGTHS[:1], 3: LENGTHS[:3], 8: LENGTHS}
NO_CACHE = "offload.gpu_cache_gib=0"
CACHE = "offload.gpu_cache_gib=0.001"  # far more than these prompts need


def tokens(path, prompts, *overrides: str) -> list[list[int]]:
    llm = LLM(str(path), overrides=CPU + list(overrides))
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture
def staged_calls(monkeypatch):
    """The batch size of every staged call, and per staged call how many ring reads it started."""
    calls: list[int] = []
    reads: list[int] = []
    current: list[int | None] = [None]
    original = staged_decode.staged_decode_attention

    def counting(reader, q, *args):
        calls.append(q.shape[0])
        current[0] = 0
        try:
            return original(reader, q, *args)
        finally:
            reads.append(current[0])
            current[0] = None

    for name in ("stream_block_groups", "gather_block_groups", "cached_block_groups"):
        def counted(self, *args, _method=getattr(OffloadEngine, name), **kwargs):
            if current[0] is not None:
                current[0] += 1
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(OffloadEngine, name, counted)
    monkeypatch.setattr("sparsekv.kvcache.offload_store.staged_decode_attention", counting)
    return calls, reads


@pytest.mark.parametrize("policy", [[], QUEST], ids=["full", "quest"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_staged_batch_equals_resident_and_cache(qwen3_ckpt, policy, batch, staged_calls):
    prompts = [random_prompt(n, seed=n) for n in BATCHES[batch]]
    resident = tokens(qwen3_ckpt, prompts, "offload.block_size=16", *policy)
    cached = tokens(qwen3_ckpt, prompts, *OFFLOAD, CACHE, *policy)
    calls, _ = staged_calls
    calls.clear()
    staged = tokens(qwen3_ckpt, prompts, *OFFLOAD, NO_CACHE, *policy)
    assert staged == resident
    assert staged == cached
    # several sequences decode together through the ring; one sequence keeps its own pipeline
    assert (max(calls, default=0) == batch) if batch > 1 else not calls


@pytest.mark.parametrize("policy", [[], QUEST], ids=["full", "quest"])
def test_cache_too_small_for_the_batch_goes_through_the_ring(qwen3_ckpt, policy, staged_calls, monkeypatch):
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    want = tokens(qwen3_ckpt, prompts, *OFFLOAD, NO_CACHE, *policy)
    calls, _ = staged_calls
    calls.clear()
    llm = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + ["offload.gpu_cache_gib=0.0001"] + policy)
    cache = llm.engine.kv_store.engine.cache
    full_blocks = sum(n // 16 for n in LENGTHS)
    assert cache is not None and 0 < cache.slots_per_layer < full_blocks
    ring_blocks: list[int] = []  # blocks each staged call read through the ring
    stream = OffloadEngine.stream_block_groups

    def streamed(self, layer, cpu_blocks, group_size=None):
        ring_blocks.append(len(cpu_blocks))
        return stream(self, layer, cpu_blocks, group_size)

    monkeypatch.setattr(OffloadEngine, "stream_block_groups", streamed)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert max(calls) == len(prompts)
    stats = llm.engine.kv_store.transfer_stats
    assert stats["cache_hit_blocks"] > 0  # what the cache holds is attended in place, in one call
    if not policy:  # full attention: only the blocks the cache could not take went through the ring
        assert 0 < sum(ring_blocks) <= stats["cache_overflow_blocks"] and max(ring_blocks) < full_blocks


@pytest.mark.parametrize("policy", [[], QUEST], ids=["full", "quest"])
def test_one_ring_read_per_layer_for_the_batch(qwen3_ckpt, policy, staged_calls):
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    calls, reads = staged_calls
    llm = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + [NO_CACHE] + policy)
    reads.clear()
    calls.clear()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert calls and max(calls) == len(prompts)
    assert max(reads) == 1  # one read for the whole batch's blocks of a layer, not one per sequence


@pytest.mark.parametrize("policy", [[], QUEST], ids=["full", "quest"])
@pytest.mark.parametrize("graph", ["cudagraph", "segmented"])
def test_staged_batch_under_emulated_graphs(qwen3_ckpt, graph, policy, staged_calls):
    prompts = [random_prompt(n, seed=n) for n in LENGTHS[:5]]
    want = tokens(qwen3_ckpt, prompts, *OFFLOAD, NO_CACHE, *policy)
    calls, _ = staged_calls
    calls.clear()
    llm = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + [NO_CACHE] + policy)
    attach_graph_runner(llm.engine, graph, llm.config.graph, emulate=True)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert calls and llm.engine.runner.graph_runner.replayed_steps > 0


@pytest.mark.parametrize("policy", [[], QUEST], ids=["full", "quest"])
def test_staged_batch_with_fp8_host_blocks_equals_per_sequence_pipelines(qwen3_ckpt, policy, staged_calls,
                                                                          monkeypatch):
    fp8 = [*OFFLOAD, NO_CACHE, "offload.host_dtype=float8_e4m3fn", *policy]
    prompts = [random_prompt(n, seed=n) for n in LENGTHS[:4]]
    calls, _ = staged_calls
    calls.clear()
    staged = tokens(qwen3_ckpt, prompts, *fp8)
    assert max(calls) == len(prompts)
    monkeypatch.setattr(OffloadKVStore, "_batched_blocks", lambda self, seqs: None)  # a pipeline per sequence
    assert staged == tokens(qwen3_ckpt, prompts, *fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", [[], QUEST], ids=["full", "quest"])
@pytest.mark.parametrize("graph", ["cudagraph", "segmented"])
def test_gpu_staged_batch_matches_resident(qwen3_ckpt, policy, graph, staged_calls):
    """On CUDA with the production kernels and captured graphs (float32): a batch of 8 mixed lengths decoded
    through the ring with no GPU block cache gives the GPU-resident tokens (resident under graph=auto: a host-side
    selection there cannot be captured whole)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    gpu = ["device=cuda", "dtype=float32", f"graph={graph}"]
    resident_settings = gpu[:-1] + ["graph=auto", "offload=none", "offload.block_size=16"] + policy
    resident = [o.token_ids for o in LLM(str(qwen3_ckpt), overrides=resident_settings).generate(prompts, GREEDY)]
    staged = [o.token_ids for o in LLM(str(qwen3_ckpt), overrides=gpu + OFFLOAD + [NO_CACHE] + policy).generate(
        prompts, GREEDY)]
    calls, _ = staged_calls
    assert calls and max(calls) == len(LENGTHS)
    assert staged == resident


QUEST_CHOOSING = ["policy=quest", "policy.topk_blocks=4", "policy.dense_layers=1", "policy.token_budget=null"]
LONG = (300, 260, 200)  # 46 full blocks of 16 tokens; each choice: the sink, the newest block and two chosen


@pytest.mark.parametrize("graph", ["eager", "cudagraph"])
@pytest.mark.parametrize("host,cache_gib", [([], "0.0004"), (["offload.host_dtype=float8_e4m3fn"], "0.0001")],
                         ids=["model-dtype", "fp8"])
def test_choices_beyond_the_cache_read_hits_in_place_and_stage_misses(qwen3_ckpt, host, cache_gib, graph,
                                                                      monkeypatch):
    """A cache that cannot hold the batch's blocks but can stage its choices: the selecting layers resolve Quest's
    device-side choices against the cache (hits in place, misses staged from the host), counted on the device, with
    the tokens of the run without a cache; the staging slots go back when the store is idle."""
    prompts = [random_prompt(n, seed=n) for n in LONG]
    want = tokens(qwen3_ckpt, prompts, *OFFLOAD, NO_CACHE, *host, *QUEST_CHOOSING)
    resolved: list[tuple[int, bool]] = []
    original = OffloadEngine.resolve_selected

    def spy(self, layer, block_ids, num_blocks):
        table = original(self, layer, block_ids, num_blocks)
        resolved.append((layer, table is not None))
        return table

    monkeypatch.setattr(OffloadEngine, "resolve_selected", spy)
    llm = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + [f"offload.gpu_cache_gib={cache_gib}"] + host + QUEST_CHOOSING)
    if graph != "eager":
        attach_graph_runner(llm.engine, graph, llm.config.graph, emulate=True)
    store = llm.engine.kv_store
    cache = store.engine.cache
    assert 2 * 3 * 4 <= cache.slots_per_layer < sum(n // 16 for n in LONG)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    # the dense layer's choice (every block) is more than the region stages: it goes through the ring
    assert {layer for layer, ok in resolved if ok} == set(range(1, llm.engine.spec.num_hidden_layers))
    assert all(not ok for layer, ok in resolved if layer == 0)
    stats = store.transfer_stats
    assert stats["cache_hit_blocks"] > 0 and stats["cache_miss_blocks"] > 0  # the first prompt's sink was evicted
    assert stats["h2d_blocks"] >= stats["cache_miss_blocks"]
    assert not any(cache.staging) and cache.capacity == cache.slots_per_layer
    if graph != "eager":
        assert llm.engine.runner.graph_runner.replayed_steps > 0


@pytest.mark.gpu
@pytest.mark.parametrize("graph", ["cudagraph", "segmented"])
def test_gpu_choices_beyond_the_cache_under_graphs(qwen3_ckpt, graph):
    """On CUDA with captured graphs (float32): Quest's choices resolved against a cache that cannot hold the batch
    give the tokens of the run without a cache, and the steps replay their captures (no capture failed)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = [random_prompt(n, seed=n) for n in LONG]
    gpu = ["device=cuda", "dtype=float32", f"graph={graph}"]
    want = [o.token_ids for o in LLM(str(qwen3_ckpt), overrides=gpu + OFFLOAD + [NO_CACHE] + QUEST_CHOOSING).generate(
        prompts, GREEDY)]
    llm = LLM(str(qwen3_ckpt), overrides=gpu + OFFLOAD + ["offload.gpu_cache_gib=0.0004"] + QUEST_CHOOSING)
    cache = llm.engine.kv_store.engine.cache
    assert 2 * 3 * 4 <= cache.slots_per_layer < sum(n // 16 for n in LONG)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    runner = llm.engine.runner.graph_runner
    assert not runner.layouts.disabled and runner.replayed_steps > 0
    stats = llm.engine.kv_store.transfer_stats
    assert stats["cache_hit_blocks"] > 0 and stats["cache_miss_blocks"] > 0


WIDE = [random_prompt(170 + (37 * i) % 80, seed=100 + i) for i in range(64)]  # 64 lengths: 10 to 15 full blocks


@pytest.mark.parametrize("cache,path", [(NO_CACHE, "ring"), ("offload.gpu_cache_gib=0.0075", "resolved")])
def test_batch_of_64_mixed_lengths_equals_resident(qwen3_ckpt, cache, path, monkeypatch):
    """Quest over 64 sequences of different lengths decoding together through the ring, and through the cache's
    resolve of device-side choices, gives the GPU-resident tokens (the whole-batch cache path: batches of 5 and 8
    above)."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    wide = ["scheduler.max_num_seqs=64", *QUEST_CHOOSING]
    resident = LLM(str(qwen3_ckpt), overrides=CPU + ["offload.block_size=16", *wide]).generate(WIDE, params)
    resolved: list[bool] = []
    original = OffloadEngine.resolve_selected
    monkeypatch.setattr(OffloadEngine, "resolve_selected",
                        lambda self, *args: (lambda table: resolved.append(table is not None) or table)(
                            original(self, *args)))
    llm = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + [cache, *wide])
    assert [o.token_ids for o in llm.generate(WIDE, params)] == [o.token_ids for o in resident]
    assert max(llm.engine.stats.step_batch_sizes) == 64
    assert any(resolved) == (path == "resolved")
