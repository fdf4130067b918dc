"""The GPU block cache (offload.gpu_cache_gib): host blocks stay on the device once loaded. On CPU the "device" is
the CPU: the same bookkeeping, copies and attention paths run, so the tokens must equal the cache-off run exactly."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.graphs.cuda_graph import attach_graph_runner
from sparsekv.kvcache.gpu_block_cache import FREE, GpuBlockCache
from tests.conftest import random_prompt

CPU = ["device=cpu", "dtype=float32", "graph=eager"]
OFFLOAD = ["offload=cpu", "offload.host_pool_gib=0.05", "offload.block_size=16", "offload.num_gpu_blocks=2",
           "offload.prefill_chunk_size=32"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=n) for n in (90, 41, 9, 140)]
LAYERS, BLOCK_BYTES = 3, 2 * 16 * 2 * 16 * 4  # tiny checkpoint: K and V of one 16-token block of one layer


def cache_gib(slots_per_layer: int) -> str:
    return f"offload.gpu_cache_gib={slots_per_layer * LAYERS * BLOCK_BYTES / (1 << 30)!r}"


def generate(path, *extra: str, prompts=PROMPTS, graph: str | None = None) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), overrides=CPU + OFFLOAD + list(extra))
    if graph is not None:
        attach_graph_runner(llm.engine, graph, llm.config.graph, emulate=True)
    return llm, [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def uncached(qwen3_ckpt):
    return generate(qwen3_ckpt, "offload.gpu_cache_gib=0")


# ---------------------------------------------------------------- bookkeeping
def make_cache(slots_per_layer: int) -> GpuBlockCache:
    return GpuBlockCache(2, slots_per_layer, 4, 1, 8, torch.float32, torch.device("cpu"))


def test_lookup_hits_misses_and_runs_of_slots():
    cache, stats = make_cache(4), {}
    cache.begin_step()
    slots, loads = cache.lookup(1, [7, 8, 9], stats)
    assert slots == [4, 5, 6] and loads == [(7, 4), (8, 5), (9, 6)]  # layer 1's region, consecutive
    cache.begin_step()
    slots, loads = cache.lookup(1, [7, 8, 9, 10], stats)
    assert slots == [4, 5, 6, 7] and loads == [(10, 7)]  # the new block continues the run
    assert stats == {"cache_hit_blocks": 3, "cache_miss_blocks": 4, "cache_overflow_blocks": 0}
    assert cache.lookup(0, [7], stats)[0] == [0]  # another layer: another entry


def test_epoch_moves_when_misses_load_so_graphs_do_not_replay_their_copies():
    cache, stats = make_cache(4), {}
    cache.begin_step()
    epoch = cache.epoch
    cache.lookup(0, [1, 2], stats)  # misses loaded: a graph captured over this step copies them
    assert cache.epoch != epoch
    cache.begin_step()
    epoch = cache.epoch
    cache.lookup(0, [1, 2], stats)  # all hits: a graph of this step replays as is
    assert cache.epoch == epoch


def test_lru_eviction_never_takes_a_block_of_the_same_step():
    cache, stats = make_cache(2), {}
    cache.begin_step()
    cache.lookup(0, [1, 2], stats)
    cache.begin_step()
    epoch = cache.epoch
    slots, loads = cache.lookup(0, [2, 3, 4], stats)  # 2 hits; 3 evicts 1 (older); 4 finds nothing free: ring
    assert slots == [1, 0, None] and loads == [(3, 0)]
    assert stats["cache_overflow_blocks"] == 1 and cache.epoch > epoch
    assert cache.stats["cache_evicted_blocks"] == 1 and 1 not in cache.slot_of[0]
    cache.begin_step()
    slots, _ = cache.lookup(0, [5], stats)  # least recently used goes first: block 2 and 3 tie, both older
    assert slots[0] in (0, 1)


def test_write_through_takes_a_slot_or_leaves_the_block_uncached():
    cache, stats = make_cache(1), {}
    cache.begin_step()
    assert cache.write_slot(0, 3) == 0
    assert cache.lookup(0, [3], stats)[1] == []  # written through: a hit
    assert cache.write_slot(0, 4) is None  # the only slot was used this step
    assert 4 not in cache.slot_of[0] and stats["cache_hit_blocks"] == 1


def test_staging_slots_are_set_aside_never_evicted_and_released():
    cache, stats = make_cache(6), {}
    cache.begin_step()
    cache.lookup(1, [10, 11, 12, 13], stats)  # slots 6..9 of layer 1's region
    cache.begin_step()
    cache.lookup(1, [12, 13], stats)  # 10 and 11 are now the least recently used
    cache.begin_step()
    epoch = cache.epoch
    staged = cache.reserve_staging(1, 3)  # the two free slots first, then the least recently used block (10)
    assert sorted(staged) == [6, 10, 11] and cache.epoch > epoch
    assert 10 not in cache.slot_of[1] and {11, 12, 13} <= set(cache.slot_of[1])
    assert cache.capacity == 3 and cache.reserve_staging(1, 2) == staged[:2]  # what is held is handed out again
    assert cache.slot_table(1, 15) == [-1] * 11 + [7, 8, 9, -1]
    assert cache.reserve_staging(1, 4) is None  # more than half the region
    cache.begin_step()
    slots, _ = cache.lookup(1, [20, 21, 22], stats)  # evictions take blocks, never a staging slot
    assert not set(slots) & set(staged) and cache.write_slot(1, 23) not in staged
    epoch = cache.epoch
    cache.release_staging()
    assert cache.capacity == 6 and cache.epoch > epoch and not any(cache.staging)
    cache.begin_step()
    assert cache.lookup(1, [30], stats)[0][0] in staged  # back among the free slots


def bookkeeping(cache: GpuBlockCache) -> tuple:
    return ([dict(table) for table in cache.slot_of], list(cache.block_in), list(cache.last_used),
            [list(free) for free in cache.free], cache.epoch, dict(cache.stats))


def test_take_run_takes_exactly_the_slots_given():
    cache, stats = make_cache(6), {}
    cache.begin_step()
    cache.lookup(1, [3, 4], stats)  # slots 6, 7
    epoch = cache.epoch
    assert cache.take_run(1, [5, 6], 8) == [8, 9]  # free slots right after the run
    assert cache.slot_of[1] == {3: 6, 4: 7, 5: 8, 6: 9} and cache.epoch > epoch
    assert not {8, 9} & set(cache.free[1]) and cache.last_used[8] == cache.last_used[9] == cache.step
    cache.begin_step()
    assert cache.take_run(1, [5, 6, 7], 8) == [8, 9, 10]  # two hold their blocks already, one is free
    assert cache.last_used[8] == cache.step  # protected for this step too
    assert cache.lookup(1, [3, 4, 5, 6, 7], stats)[0] == [6, 7, 8, 9, 10]
    assert stats["cache_miss_blocks"] == 2  # take_run loads and counts nothing
    cache.begin_step()
    cache.lookup(0, [9], stats)  # slot 0
    cache.begin_step()
    assert cache.take_run(0, [9], 2) == [2]  # an entry elsewhere, not used this step: moved (it is rewritten)
    assert cache.slot_of[0] == {9: 2} and cache.block_in[0] == FREE and 0 in cache.free[0]


def test_take_run_refuses_without_side_effects():
    cache, stats = make_cache(4), {}
    cache.begin_step()
    cache.lookup(0, [1, 2], stats)  # slots 0, 1
    assert cache.reserve_staging(1, 1) == [4]
    before = bookkeeping(cache)
    assert cache.take_run(0, [3, 4], 1) is None  # slot 1 holds another block
    assert cache.take_run(0, [3, 4], 3) is None  # slot 4 is layer 1's
    assert cache.take_run(1, [3], 4) is None  # a staging slot
    assert cache.take_run(0, [1], 2) is None  # block 1 was used this step in slot 0
    assert cache.take_run(0, [], 2) is None
    assert bookkeeping(cache) == before


# ---------------------------------------------------------------- the engine with a cache
@pytest.mark.parametrize("slots", [64, 3, 1])  # everything fits; less than one step's selection; one slot
def test_cache_gives_the_uncached_tokens(qwen3_ckpt, uncached, slots):
    llm, got = generate(qwen3_ckpt, cache_gib(slots))
    assert got == uncached[1]
    cache = llm.engine.kv_store.engine.cache
    assert cache.slots_per_layer == slots
    stats = llm.engine.kv_store.cache_stats
    assert stats["cache_hit_blocks"] > 0
    assert llm.engine.kv_store.transfer_stats["h2d_blocks"] < uncached[0].engine.kv_store.transfer_stats["h2d_blocks"]
    if slots == 64:
        assert stats["cache_overflow_blocks"] == 0
    else:
        assert stats["cache_overflow_blocks"] > 0  # streamed through the ring


def test_full_attention_with_the_whole_context_cached_copies_nothing(qwen3_ckpt):
    llm, _ = generate(qwen3_ckpt, cache_gib(64), prompts=[PROMPTS[0]])
    store = llm.engine.kv_store
    assert store.transfer_stats["h2d_blocks"] == 0  # every offloaded block was written through
    before = dict(store.cache_stats)
    llm.generate([PROMPTS[0]], GREEDY)  # its blocks were released and rewritten: still nothing from the host
    assert store.transfer_stats["h2d_blocks"] == 0
    assert store.cache_stats["cache_hit_blocks"] > before["cache_hit_blocks"]


@pytest.mark.parametrize("policy", [[], ["policy=quest", "policy.topk_blocks=3", "policy.dense_layers=1",
                                         "policy.token_budget=null"]])
@pytest.mark.parametrize("graph", ["cudagraph", "segmented"])
def test_cache_under_emulated_graphs(qwen3_ckpt, policy, graph):
    _, want = generate(qwen3_ckpt, "offload.gpu_cache_gib=0", *policy)
    for slots in (64, 2):
        llm, got = generate(qwen3_ckpt, cache_gib(slots), *policy, graph=graph)
        assert got == want, slots
        assert llm.engine.runner.graph_runner.replayed_steps > 0


def test_mixed_prefill_chunks_reread_from_the_cache(qwen3_ckpt, uncached):
    """Chunked prefill re-reads the earlier blocks of a long prompt every chunk: with a cache, after write-through
    they are hits."""
    llm, got = generate(qwen3_ckpt, cache_gib(64), "scheduler.max_num_seqs=1")
    assert got == uncached[1]
    assert llm.engine.kv_store.cache_stats["cache_miss_blocks"] == 0


def test_bad_gpu_cache_size_is_refused_at_compose_time():
    for bad in ("-1", "lots"):
        with pytest.raises(ValueError, match=rf"offload.gpu_cache_gib='?{bad}'? is not valid; use auto, 0"):
            LLM("tiny", overrides=CPU + ["offload=cpu", f"offload.gpu_cache_gib={bad}"])


def test_bench_records_the_cache(tmp_path):
    import json

    from sparsekv.llm import compose_config
    from sparsekv.tasks import get_task

    cfg = compose_config(["task=bench", f"output_dir={tmp_path}", "task.progress=false", "device=cpu",
                          "offload=cpu", "offload.block_size=16", "offload.gpu_cache_gib=0.01", "task.context=64",
                          "task.decode_steps=3", "task.warmup=false"])
    get_task(cfg.task.name)(cfg)
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["gpu_cache"]["cache_slots"] > 0 and record["gpu_cache_gib"] > 0
    assert record["gpu_cache_hit_rate"] == 1.0  # written through in prefill, read in place in decode
    assert record["kv_transfer"]["decode_per_step"]["h2d_bytes"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("graph", ["eager", "cudagraph"])
@pytest.mark.parametrize("policy", [[], ["policy=quest", "policy.topk_blocks=3", "policy.dense_layers=1",
                                         "policy.token_budget=null"]], ids=["full", "quest"])
def test_gpu_cache_gives_the_uncached_tokens(qwen3_ckpt, graph, policy, monkeypatch):
    """On CUDA the cache's loads, write-throughs and reads are ordered by stream events alone: with the same
    attention on both sides (float32; the reference eagerly, the Triton kernels, which captured steps need, under
    cudagraph), tokens with a cache (large, and smaller than a step's selection) equal those without, eager and
    captured, batch and single sequences."""
    monkeypatch.setenv("SPARSEKV_ATTN_BACKEND", "torch" if graph == "eager" else "triton")
    cuda = ["device=cuda", "dtype=float32", f"graph={graph}"] + OFFLOAD + policy
    want = [o.token_ids for o in LLM(str(qwen3_ckpt), overrides=cuda + ["offload.gpu_cache_gib=0"]).generate(
        PROMPTS, GREEDY)]
    for slots in (64, 2):
        llm = LLM(str(qwen3_ckpt), overrides=cuda + [cache_gib(slots)])
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want, slots
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == want[:1], slots
        assert llm.engine.kv_store.cache_stats["cache_hit_blocks"] > 0


# ---------------------------------------------------------------- prefill chunks as one view (sequence_kv)
def record_sequence_kv(llm: LLM) -> list[tuple]:
    """Every compute_chunked_prefill call of the prefill policy, copied: (layer, query_start, k, v, sequence_kv,
    the prefix's K/V as the host holds them then)."""
    store = llm.engine.kv_store
    policy, calls = store.prefill_policy, []
    compute = policy.compute_chunked_prefill

    def recording(q, k, v, ctx, reader):
        view = None if ctx.sequence_kv is None else tuple(t.clone() for t in ctx.sequence_kv)
        host = [store.host.block(ctx.layer, block) for block in ctx.candidates]
        prefix = tuple(torch.cat([kv[i] for kv in host]) if host else k[:0] for i in (0, 1))
        calls.append((ctx.layer, ctx.query_start, k.clone(), v.clone(), view, prefix))
        return compute(q, k, v, ctx, reader)

    policy.compute_chunked_prefill = recording
    return calls


def test_prefill_chunks_see_the_sequence_so_far_as_one_view(qwen3_ckpt):
    # 90 tokens in chunks of 32: the chunks after the first see every earlier key and their own in one view
    _, want = generate(qwen3_ckpt, "offload.gpu_cache_gib=0", prompts=PROMPTS[:1])
    llm = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + [cache_gib(64)])
    calls = record_sequence_kv(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == want
    keys, values = {}, {}
    for layer, start, k, v, view, _ in calls:
        keys[layer] = torch.cat([keys[layer], k]) if start else k
        values[layer] = torch.cat([values[layer], v]) if start else v
        if start:
            assert torch.equal(view[0], keys[layer]) and torch.equal(view[1], values[layer])
        else:
            assert view is None
    assert [start for layer, start, *_ in calls if layer == 0] == [0, 32, 64]
    store = llm.engine.kv_store
    stats = store.cache_stats
    assert stats["cache_miss_blocks"] == 0 and store.transfer_stats["h2d_blocks"] == 0
    assert stats["cache_written_blocks"] == store.transfer_stats["d2h_blocks"]  # each offloaded block written once


def test_batch_prefill_gives_each_chunk_its_own_view(qwen3_ckpt, uncached):
    llm = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + [cache_gib(64)])
    store = llm.engine.kv_store
    calls, chunks_per_step = record_sequence_kv(llm), []
    begin_step = store.begin_step

    def counting(context):
        if context.is_prefill:
            chunks_per_step.append(len(context.chunks))
        begin_step(context)

    store.begin_step = counting
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == uncached[1]
    assert max(chunks_per_step) > 1  # a step prefilled one sequence's last chunk and another's first
    with_prefix = [call for call in calls if call[1]]
    assert with_prefix and all(view is not None for *_, view, _ in with_prefix)
    for _, _, k, v, view, prefix in with_prefix:
        assert torch.equal(view[0], torch.cat([prefix[0], k])) and torch.equal(view[1], torch.cat([prefix[1], v]))
    assert all(view is None for _, start, _, _, view, _ in calls if not start)
    assert store.cache_stats["cache_written_blocks"] == store.transfer_stats["d2h_blocks"]


@pytest.mark.parametrize("extra", [["offload.gpu_cache_gib=0"], [cache_gib(64), "offload.host_dtype=float8_e4m3fn"]],
                         ids=["no-cache", "fp8-host"])
def test_no_view_without_a_cache_or_with_fp8_blocks(qwen3_ckpt, extra):
    llm = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + extra)
    assert (llm.engine.kv_store.engine.cache is None) == (extra == ["offload.gpu_cache_gib=0"])
    calls = record_sequence_kv(llm)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert len(calls) == 3 * LAYERS and all(view is None for *_, view, _ in calls)
