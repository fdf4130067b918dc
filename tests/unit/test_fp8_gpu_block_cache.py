"""The GPU block cache with the fp8 host tier (offload.host_dtype=float8_e4m3fn, offload.gpu_cache_gib): the cache
holds each block exactly as the host does, fp8 K/V and their per-(block, KV head) scales, written through from the
quantized offload and loaded from the host with the scales; a cache hit is read by the same dequantize-on-load
kernels as a ring slot. On CPU (float32 model) the tokens with the cache equal those without it exactly."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.graphs.cuda_graph import attach_graph_runner
from sparsekv.kernels.fp8_kv import FP8_DTYPE
from sparsekv.kvcache import batched_decode, staged_decode
from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.kvcache.reader import RingReader
from tests.conftest import random_prompt

BS, KVH, D, LAYERS, BLOCKS = 4, 2, 8, 2, 6
CPU_DEVICE = torch.device("cpu")
CPU = ["device=cpu", "dtype=float32", "graph=eager"]
FP8 = "offload.host_dtype=float8_e4m3fn"
OFFLOAD = ["offload=cpu", "offload.host_pool_gib=0.05", "offload.block_size=16", "offload.num_gpu_blocks=4",
           "offload.prefill_chunk_size=32", FP8]
QUEST = ["policy=quest", "policy.topk_blocks=3", "policy.dense_layers=1", "policy.token_budget=null"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=n) for n in (90, 41, 9, 140)]  # mixed lengths: 0 to 8 full blocks
# tiny checkpoint (3 layers, 2 KV heads of 16): K and V of one 16-token block of one layer in fp8, scales included
CKPT_LAYERS, FP8_BLOCK_BYTES = 3, 2 * (16 * 2 * 16 + 2 * 4)


def cache_gib(slots_per_layer: int) -> str:
    return f"offload.gpu_cache_gib={slots_per_layer * CKPT_LAYERS * FP8_BLOCK_BYTES / (1 << 30)!r}"


def generate(path, *extra: str, graph: str | None = None) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), overrides=CPU + OFFLOAD + list(extra))
    if graph is not None:
        attach_graph_runner(llm.engine, graph, llm.config.graph, emulate=True)
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


# ---------------------------------------------------------------- the engine: cached blocks equal host blocks
def _engine(cache_slots: int) -> OffloadEngine:
    """An fp8 engine with a GPU block cache whose blocks were offloaded (and written through) from float32 K/V, one
    head 1000x larger than the other."""
    host = HostPool(LAYERS, BLOCKS, BS, KVH, D, FP8_DTYPE, pin_memory=False)
    host.ensure_capacity(BLOCKS)
    engine = OffloadEngine(host, 4, BLOCKS * BS, 1, CPU_DEVICE, model_dtype=torch.float32,
                           cache_slots_per_layer=cache_slots)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(LAYERS, BLOCKS * BS, KVH, D, generator=g) for _ in range(2))
    k[:, :, 1] *= 1000.0
    engine.begin_step()
    for layer in range(LAYERS):
        engine.write_prefill_buffer(layer, k[layer], v[layer])
        for block in range(BLOCKS):
            engine.offload_prefill_buffer_async(layer, block, BS, block * BS)
    return engine


def _assert_cached_as_on_host(engine: OffloadEngine, layer: int, block: int) -> None:
    cache, fp8 = engine.cache, engine.fp8
    slot = cache.slot_of[layer][block]
    host_k, host_v = engine.host.block(layer, block)
    host_ks, host_vs = fp8._host_scales(layer, block, 1)
    assert cache.k.dtype == FP8_DTYPE
    assert torch.equal(cache.k[slot].view(torch.uint8), host_k.view(torch.uint8))
    assert torch.equal(cache.v[slot].view(torch.uint8), host_v.view(torch.uint8))
    assert torch.equal(cache.scales[0, slot], host_ks[0]) and torch.equal(cache.scales[1, slot], host_vs[0])
    assert host_ks[0, 1] > 100 * host_ks[0, 0]  # the large head's scale, not a copy of the other head's


def test_written_through_and_loaded_blocks_equal_the_host_blocks():
    engine = _engine(cache_slots=3)
    cache = engine.cache
    assert cache.bytes == LAYERS * 3 * 2 * (BS * KVH * D + KVH * 4)  # fp8 blocks and their float32 scales
    for layer in range(LAYERS):
        assert sorted(cache.slot_of[layer]) == [0, 1, 2]  # written through until the region was full
        for block in range(3):
            _assert_cached_as_on_host(engine, layer, block)
    engine.begin_step()
    seen = []
    for (ids, k, v), scales in RingReader(engine, layer=1).scaled_groups([5, 4, 0]):  # two loaded, one evicted
        assert k.dtype == FP8_DTYPE and scales[0].shape == (len(ids), KVH)
        for i, block in enumerate(ids):
            host_k, _ = engine.host.block(1, block)
            assert torch.equal(k[i * BS:(i + 1) * BS].view(torch.uint8), host_k.view(torch.uint8))
            assert torch.equal(scales[0][i], engine.fp8._host_scales(1, block, 1)[0][0])
        seen += ids
    assert seen == [5, 4, 0]
    for block in (5, 4, 0):
        _assert_cached_as_on_host(engine, 1, block)
    assert engine.transfer_stats["cache_miss_blocks"] == 2 and engine.transfer_stats["cache_hit_blocks"] == 1
    assert engine.transfer_stats["h2d_bytes"] == 2 * 2 * (BS * KVH * D + KVH * 4)  # fp8 bytes and scales


def test_ring_groups_of_cached_blocks_carry_their_scales():
    """With an explicit group size, cached blocks in scattered slots are copied into the ring with their scales;
    groups() dequantizes cache runs and ring groups alike."""
    engine = _engine(cache_slots=3)
    engine.begin_step()
    scaled = []
    for (ids, k, _), (k_scale, _) in RingReader(engine, layer=0).scaled_groups([2, 0, 1], group_size=2):
        host = torch.cat([engine.fp8._host_scales(0, block, 1)[0] for block in ids])  # [n, KVH]
        assert torch.equal(k_scale, host)
        scaled.append((ids, k.float().unflatten(0, (-1, BS)) * k_scale[:, None, :, None]))
    assert engine.transfer_stats["h2d_blocks"] == 0  # [2, 0] copied from the cache into the ring, [1] in place
    plain = list(RingReader(engine, layer=0).groups([2, 0, 1], group_size=2))
    assert [ids for ids, _ in scaled] == [ids for ids, _, _ in plain] == [[2, 0], [1]]
    for (_, want), (_, k, _) in zip(scaled, plain):
        assert k.dtype == torch.float32
        torch.testing.assert_close(k, want.flatten(0, 1), rtol=0, atol=0)


# ---------------------------------------------------------------- the engine: tokens equal the cache-off run
@pytest.fixture(scope="module")
def uncached(qwen3_ckpt):
    return {name: generate(qwen3_ckpt, "offload.gpu_cache_gib=0", *policy)[1]
            for name, policy in (("full", []), ("quest", QUEST))}


@pytest.fixture
def paths(monkeypatch):
    """Which batched decode paths ran: over the cache (batched) and through the ring (staged)."""
    seen = {"batched": 0, "staged": 0}
    for name, module in (("batched", batched_decode), ("staged", staged_decode)):
        original = getattr(module, f"{name}_decode_attention")

        def counted(*args, _original=original, _name=name, **kwargs):
            seen[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(f"sparsekv.kvcache.offload_store.{name}_decode_attention", counted)
    return seen


@pytest.mark.parametrize("policy", ["full", "quest"])
@pytest.mark.parametrize("slots", [64, 3])  # everything fits; less than one step's selection (eviction, overflow)
def test_fp8_cache_gives_the_uncached_tokens(qwen3_ckpt, uncached, policy, slots, paths):
    llm, got = generate(qwen3_ckpt, cache_gib(slots), *(QUEST if policy == "quest" else []))
    assert got == uncached[policy]
    store = llm.engine.kv_store
    assert store.engine.cache.slots_per_layer == slots  # sized by fp8 bytes plus scales
    assert store.engine.cache.k.dtype == FP8_DTYPE
    stats = store.cache_stats
    assert stats["cache_hit_blocks"] > 0 and stats["cache_written_blocks"] > 0
    if slots == 64:
        assert stats["cache_overflow_blocks"] == 0 and paths["batched"] > 0  # the batch decoded over the cache
        assert store.transfer_stats["h2d_blocks"] == 0  # every block written through, read in place
    else:
        assert stats["cache_overflow_blocks"] > 0 and stats["cache_evicted_blocks"] > 0
        assert paths["staged"] > 0  # the batch through the ring, its cached blocks device to device


@pytest.mark.parametrize("policy", ["full", "quest"])
@pytest.mark.parametrize("graph", ["cudagraph", "segmented"])
def test_fp8_cache_under_emulated_graphs(qwen3_ckpt, uncached, policy, graph):
    for slots in (64, 2):
        llm, got = generate(qwen3_ckpt, cache_gib(slots), *(QUEST if policy == "quest" else []), graph=graph)
        assert got == uncached[policy], slots
        assert llm.engine.runner.graph_runner.replayed_steps > 0


def test_bench_counts_fp8_bytes_with_the_cache(tmp_path):
    import json

    from sparsekv.llm import compose_config
    from sparsekv.tasks import get_task

    cfg = compose_config(["task=bench", f"output_dir={tmp_path}", "task.progress=false", "device=cpu",
                          "offload=cpu", "offload.block_size=16", "offload.gpu_cache_gib=0.01", FP8,
                          "task.context=64", "task.decode_steps=3", "task.warmup=false"])
    get_task(cfg.task.name)(cfg)
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["gpu_cache"]["cache_slots"] > 0 and record["gpu_cache_hit_rate"] == 1.0
    assert record["kv_transfer"]["decode_per_step"]["h2d_bytes"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("policy", [[], QUEST], ids=["full", "quest"])
def test_gpu_fp8_cache_auto_gives_the_uncached_tokens(qwen3_ckpt, policy, monkeypatch):
    """On CUDA with captured graphs and the Triton kernels (float32 model, fp8 host tier): cache auto (everything
    resident after the prefill) and a cache smaller than a step's selection give the tokens of the cache off,
    for a batch of mixed lengths and one sequence."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("SPARSEKV_ATTN_BACKEND", "triton")
    cuda = ["device=cuda", "dtype=float32", "graph=cudagraph"] + OFFLOAD + policy
    want = [o.token_ids for o in LLM(str(qwen3_ckpt), overrides=cuda + ["offload.gpu_cache_gib=0"]).generate(
        PROMPTS, GREEDY)]
    for cache in ("offload.gpu_cache_gib=auto", cache_gib(2)):
        llm = LLM(str(qwen3_ckpt), overrides=cuda + [cache])
        assert llm.engine.kv_store.engine.cache.k.dtype == FP8_DTYPE
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want, cache
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == want[:1], cache
        assert llm.engine.kv_store.cache_stats["cache_hit_blocks"] > 0
        assert llm.engine.runner.graph_runner is not None
