"""MInference's offloaded prefill when the GPU block cache holds the whole prefix in one run of slots.

With the store's view of the prefix and the chunk (PolicyContext.sequence_kv) the chunk is compute_prefill on it, one
attention call. Without it, the prefix is still attended like offload=none: one estimate over all keys and two
attention calls per chunk, whatever the number of prefix blocks, with offload=none's pattern and result. Of a prefix
the cache holds only in part, the leading cached run is one group of the online per-group selection (policy module
docstring); the rest streams.
"""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import flash_attn_with_lse_reference
from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.kvcache.reader import RingReader
from sparsekv.policies.context import PolicyContext
from sparsekv.policies.minference import policy as minference_module
from sparsekv.policies.minference.policy import SLASH_BAND, MInferencePolicy

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EXACT = 3e-3 if DEV.type == "cuda" else 1e-5  # relative error of "exact" results (tf32 tl.dot on the GPU)
SCALE = 0.25

pytestmark = pytest.mark.usefixtures("triton_kernels")


def _qkv(n: int, S: int, seed: int, h: int = 4, kvh: int = 2, d: int = 16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, d, generator=gen).to(DEV), torch.randn(S, kvh, d, generator=gen).to(DEV),
            torch.randn(S, kvh, d, generator=gen).to(DEV))


def _engine(k, v, c0: int, bs: int, slots: int, cache_slots: int) -> tuple[OffloadEngine, list[int]]:
    """The prefix k/v[:c0] offloaded to host blocks 0.. (written through to a GPU block cache of cache_slots)."""
    S, kvh, d = k.shape
    nblk = c0 // bs
    host = HostPool(1, nblk + 1, bs, kvh, d, k.dtype, pin_memory=False)
    host.ensure_capacity(nblk + 1)
    engine = OffloadEngine(host, slots, S, 1, DEV, cache_slots_per_layer=cache_slots)
    engine.write_prefill_buffer(0, k[:c0], v[:c0])
    table = list(range(nblk))
    for i, block in enumerate(table):
        engine.offload_prefill_buffer_async(0, block, bs, i * bs)
    return engine, table


def _offloaded(policy, q, k, v, c0: int, bs: int, slots: int = 4, cache_slots: int = 0) -> torch.Tensor:
    """The chunk at c0.. through compute_chunked_prefill; it ends its prompt, as compute_prefill's whole prompt does."""
    engine, table = _engine(k, v, c0, bs, slots, cache_slots)
    ctx = PolicyContext(phase="prefill", layer=0, query=q, candidates=table, block_size=bs, query_start=c0,
                        kv_len=c0 + q.shape[0], softmax_scale=SCALE, chunk_keys=k[c0:], prompt_len=c0 + q.shape[0])
    return policy.compute_chunked_prefill(q, k[c0:], v[c0:], ctx, RingReader(engine, 0))


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts the policy's vertical_slash_attention calls and the keys they are given."""
    calls = {"calls": 0, "keys": 0}
    kernel = minference_module.vertical_slash_attention

    def counted(q, k, *args, **kwargs):
        calls["calls"] += 1
        calls["keys"] += k.shape[0]
        return kernel(q, k, *args, **kwargs)

    monkeypatch.setattr(minference_module, "vertical_slash_attention", counted)
    return calls


def _policy(**overrides) -> MInferencePolicy:
    fields = dict(last_q=16, vertical_size=24, slash_size=48, sink_tokens=4, recent_diagonals=8, slash_granularity=1)
    return MInferencePolicy(**{**fields, **overrides})


@pytest.mark.parametrize("c0,overrides", [
    (256, {}),
    (512, {}),  # twice the blocks: still two attention calls
    (256, {"slash_granularity": SLASH_BAND, "slash_size": SLASH_BAND}),
    (256, {"slash_excludes_vertical": True}),
])
def test_cached_prefix_equals_resident_in_two_calls(c0, overrides, attention_calls):
    n, bs = 64, 16
    q, k, v = _qkv(n, c0 + n, seed=c0 + len(overrides))
    policy = _policy(**overrides)
    expected = policy.compute_prefill(q, k, v, 0, SCALE)
    resident_density = policy.last_density
    attention_calls.update(calls=0, keys=0)
    out = _offloaded(policy, q, k, v, c0, bs, slots=4, cache_slots=c0 // bs + 2)
    # the streamed path would make one call per ring group of 2 blocks plus one for the chunk (c0 // 32 + 1)
    assert attention_calls == {"calls": 2, "keys": c0 + n}
    assert ((out - expected).norm() / expected.norm()).item() < EXACT
    assert policy.last_density == pytest.approx(resident_density, rel=1e-6)
    assert policy.last_density < 0.5


def test_sequence_view_is_computed_as_offload_none(attention_calls):
    c0, n, bs = 256, 64, 16
    q, k, v = _qkv(n, c0 + n, seed=5)
    policy = _policy()
    expected = policy.compute_prefill(q, k, v, 0, SCALE)
    attention_calls.update(calls=0, keys=0)
    engine, table = _engine(k, v, c0, bs, slots=4, cache_slots=0)  # nothing cached: the view alone decides
    ctx = PolicyContext(phase="prefill", layer=0, query=q, candidates=table, block_size=bs, query_start=c0,
                        kv_len=c0 + n, softmax_scale=SCALE, chunk_keys=k[c0:], sequence_kv=(k, v),
                        prompt_len=c0 + n)
    out = policy.compute_chunked_prefill(q, k[c0:], v[c0:], ctx, RingReader(engine, 0))
    assert attention_calls == {"calls": 1, "keys": c0 + n} and engine.transfer_stats["h2d_blocks"] == 0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("budget", ["full", "small"])
def test_partly_cached_prefix_streams_the_rest_then_the_cached_run_as_one_group(budget, attention_calls, monkeypatch):
    # the cache holds the oldest half of the prefix: the newer half streams in groups of half the ring (2 blocks),
    # newest first, then the cached run is one group, then the chunk
    c0, n, bs = 256, 64, 16
    q, k, v = _qkv(n, c0 + n, seed=3)
    if budget == "full":  # every key kept: dense attention, exactly, through the sparse path
        monkeypatch.setattr(MInferencePolicy, "dense_when_all_kept", False)
        policy = _policy(vertical_size=10 ** 6, slash_size=10 ** 6)
    else:
        policy = _policy()
    ring_only = _offloaded(policy, q, k, v, c0, bs)
    ring_density = policy.last_density
    assert attention_calls["calls"] == c0 // (2 * bs) + 1
    attention_calls.update(calls=0, keys=0)
    out = _offloaded(policy, q, k, v, c0, bs, cache_slots=c0 // (2 * bs))
    assert attention_calls == {"calls": c0 // (4 * bs) + 2, "keys": c0 + n}
    if budget == "full":
        for result in (out, ring_only):
            dense = flash_attn_with_lse_reference(q.cpu(), k.cpu(), v.cpu(), SCALE, causal=True)[0]
            assert ((result.cpu() - dense).norm() / dense.norm()).item() < EXACT
        assert policy.last_density == pytest.approx(1.0)
    else:
        assert torch.isfinite(out).all() and 0.0 < policy.last_density < 0.5 and ring_density < 0.5


def test_reader_resident_is_the_leading_cached_run_read_in_place():
    c0, bs = 128, 16
    _, k, v = _qkv(1, c0, seed=4)
    engine, table = _engine(k, v, c0, bs, slots=4, cache_slots=c0 // bs)
    reader = RingReader(engine, 0)
    group = reader.resident(table)
    assert group is not None and group.ids == table
    assert torch.equal(group.k, k) and torch.equal(group.v, v)
    assert group.k.data_ptr() == engine.cache.k.data_ptr()  # read in place
    assert engine.transfer_stats["cache_hit_blocks"] == len(table)
    assert reader.resident([99] + table) is None  # the cache does not hold the first block
    assert engine.transfer_stats["cache_hit_blocks"] == len(table)  # a refusal counts nothing
    assert reader.resident(table[::-1]).ids == table[-1:]  # the leading run in this order: one block
    assert reader.resident(table[:3] + [99] + table[3:]).ids == table[:3]
    assert engine.transfer_stats["cache_hit_blocks"] == len(table) + 4  # only the runs returned are counted
    no_cache, table = _engine(k, v, c0, bs, slots=4, cache_slots=0)
    assert RingReader(no_cache, 0).resident(table) is None


def test_engine_with_a_gpu_block_cache_decodes_as_offload_none(qwen3_ckpt, monkeypatch):
    # small budgets, chunks of 32 tokens both ways: with the cache holding the prefix, every offloaded chunk makes
    # offload=none's selection and result, so the greedy tokens and the density are offload=none's. The resident
    # store does not say which chunk ends the prompt, so every chunk keeps one budget both ways (scale 1)
    from sparsekv import LLM, SamplingParams
    from sparsekv.kernels import _dispatch
    from tests.conftest import random_prompt

    monkeypatch.delenv(_dispatch.ENV_BACKEND, raising=False)  # references: the kernels are tested above
    common = ["device=cpu", "dtype=float32", "offload.block_size=16", "policy=minference", "policy.last_q=8",
              "policy.vertical_size=8", "policy.slash_size=8", "policy.sink_tokens=4", "policy.recent_diagonals=4",
              "policy.slash_granularity=1", "policy.early_chunk_budget_scale=1"]
    prompt, greedy = random_prompt(90, seed=13), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    resident = LLM(str(qwen3_ckpt), overrides=common + ["offload=none", "scheduler.max_num_batched_tokens=32",
                                                        "policy.whole_prompt_prefill=false"])  # the same chunks
    expected = resident.generate([prompt], greedy)[0].token_ids
    offloaded = LLM(str(qwen3_ckpt), overrides=common + ["offload=cpu", "offload.prefill_chunk_size=32",
                                                         "offload.gpu_cache_gib=0.01"])
    assert offloaded.engine.kv_store.engine.cache is not None
    assert offloaded.generate([prompt], greedy)[0].token_ids == expected
    assert offloaded.engine.policy.mean_density == pytest.approx(resident.engine.policy.mean_density, rel=1e-6)
    assert offloaded.engine.policy.mean_density < 0.8
