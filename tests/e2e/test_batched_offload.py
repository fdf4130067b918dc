"""Offloaded decode of a batch of sequences of different lengths gives each sequence the tokens it gets alone
(float32, CPU), for full attention and Quest; with a GPU block cache that holds the batch, a decode step attends the
whole batch with one paged attention call per layer instead of a pipeline per sequence."""
from __future__ import annotations

import pytest

from sparsekv import LLM, SamplingParams
from sparsekv.graphs.cuda_graph import attach_graph_runner
from sparsekv.kvcache import batched_decode
from sparsekv.policies.quest import QuestPolicy
from tests.conftest import random_prompt

CPU = ["device=cpu", "dtype=float32", "graph=eager"]
OFFLOAD = ["offload=cpu", "offload.host_pool_gib=0.05", "offload.block_size=16", "offload.num_gpu_blocks=2",
           "offload.prefill_chunk_size=32"]
QUEST = ["policy=quest", "policy.topk_blocks=2", "policy.dense_layers=1", "policy.token_budget=null"]
QUEST_MIDDLE = ["policy=quest", "policy.topk_blocks=3", "policy.dense_layers=1", "policy.token_budget=null"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=n) for n in (90, 7, 41, 130, 16)]  # 0 to 8 full blocks, partial and whole tails
CACHE = "offload.gpu_cache_gib=0.001"  # far more than these prompts need


def run(path, prompts, *extra: str, graph: str | None = None) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), overrides=CPU + OFFLOAD + list(extra))
    if graph is not None:
        attach_graph_runner(llm.engine, graph, llm.config.graph, emulate=True)
    return llm, [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture
def count_batched(monkeypatch):
    calls = []
    original = batched_decode.batched_decode_attention

    def counting(engine, layer, q, *args):
        calls.append(q.shape[0])
        return original(engine, layer, q, *args)

    monkeypatch.setattr("sparsekv.kvcache.offload_store.batched_decode_attention", counting)
    return calls


@pytest.mark.parametrize("policy", [[], QUEST, QUEST_MIDDLE], ids=["full", "quest", "quest_middle"])
@pytest.mark.parametrize("cache", ["offload.gpu_cache_gib=0", CACHE])
def test_mixed_length_batch_equals_one_by_one(qwen3_ckpt, policy, cache, count_batched, monkeypatch):
    alone = [run(qwen3_ckpt, [prompt], *policy, cache)[1][0] for prompt in PROMPTS]
    count_batched.clear()
    rows = []  # per layer and step: how many sequences Quest chose for in one batched computation
    padded = QuestPolicy._select_padded
    monkeypatch.setattr(QuestPolicy, "_select_padded", lambda self, ctxs: rows.append(len(ctxs)) or padded(self, ctxs))
    llm, together = run(qwen3_ckpt, PROMPTS, *policy, cache)
    assert together == alone
    assert bool(count_batched) == (cache == CACHE)  # without the cache: through the ring (staged_decode.py)
    assert bool(rows) == bool(policy)  # the 90- and 130-token prompts select together
    if cache == CACHE:  # every decode step of several sequences: one call per layer for the batch
        assert max(count_batched) == len(PROMPTS)
        # Quest's choices were served from the cache: nothing came from the host in decode
        assert llm.engine.kv_store.transfer_stats["h2d_blocks"] == 0


@pytest.mark.parametrize("policy", [[], QUEST], ids=["full", "quest"])
@pytest.mark.parametrize("graph", ["cudagraph", "segmented"])
def test_batched_decode_under_emulated_graphs(qwen3_ckpt, graph, policy, count_batched):
    _, want = run(qwen3_ckpt, PROMPTS, "offload.gpu_cache_gib=0", *policy)
    llm, got = run(qwen3_ckpt, PROMPTS, CACHE, *policy, graph=graph)
    assert got == want and count_batched
    assert llm.engine.runner.graph_runner.replayed_steps > 0
