"""offload=none paged store: the sequence K/V read for chunked prefill, decode with a block-selecting policy."""
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from sparsekv.kvcache.paged import PagedKVStore
from sparsekv.policies.full import FullAttentionPolicy
from sparsekv.policies.quest import QuestPolicy


def _store() -> PagedKVStore:
    store = PagedKVStore(2, 6, 4, 2, 8, torch.float32, torch.device("cpu"), FullAttentionPolicy())
    gen = torch.Generator().manual_seed(0)
    store.k_cache.copy_(torch.randn(store.k_cache.shape, generator=gen))
    store.v_cache.copy_(torch.randn(store.v_cache.shape, generator=gen))
    return store


def test_sequence_kv_reads_blocks_in_table_order():
    store = _store()
    table = torch.tensor([4, 1, 3], dtype=torch.int32)
    k, v = store.sequence_kv(1, table, 10)  # 2.5 blocks
    expected_k = torch.cat([store.k_cache[1, b] for b in (4, 1, 3)])[:10]
    expected_v = torch.cat([store.v_cache[1, b] for b in (4, 1, 3)])[:10]
    assert k.shape == (10, 2, 8)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_sequence_kv_of_one_block_run_is_a_view_equal_to_the_gather():
    store = _store()
    table = torch.tensor([2, 3, 4], dtype=torch.int32)
    k_view, v_view = store.sequence_kv(0, table, 11, first_block=2)
    k_copy, v_copy = store.sequence_kv(0, table, 11)
    assert torch.equal(k_view, k_copy) and torch.equal(v_view, v_copy)
    assert k_view.is_contiguous() and k_view.data_ptr() == store.k_cache[0, 2].data_ptr()  # no copy
    assert v_view.data_ptr() == store.v_cache[0, 2].data_ptr()


def test_chunked_prefill_reads_runs_as_views_and_fragmented_tables_by_gather(llama_ckpt, monkeypatch):
    from sparsekv import LLM, SamplingParams
    from tests.conftest import random_prompt

    seen = []
    original = PagedKVStore.sequence_kv

    def spy(self, layer_id, block_table, num_tokens, first_block=None):
        seen.append(first_block)
        return original(self, layer_id, block_table, num_tokens, first_block)

    monkeypatch.setattr(PagedKVStore, "sequence_kv", spy)
    prompts = [random_prompt(n, seed=n) for n in (70, 33)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cpu = ["device=cpu", "dtype=float32", "offload.block_size=16"]
    one_shot = LLM(str(llama_ckpt), overrides=cpu).generate(prompts, greedy)
    llm = LLM(str(llama_ckpt), overrides=cpu + ["scheduler.max_num_batched_tokens=12"])
    free = llm.engine.block_manager.free_blocks  # a heap: taking block 1 out leaves the first sequence [0, 2, 3, ..]
    free.remove(1)
    chunked = llm.generate(prompts, greedy)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in one_shot]
    # the fragmented first and the contiguous second
    assert None in seen and any(b is not None for b in seen), set(seen)


def test_selecting_decode_policy_selects_among_resident_blocks(qwen3_ckpt):
    """offload=none with quest: decode attends to the blocks quest selects for the whole batch at once, the same ones
    as offload=cpu (equal greedy tokens), and only those (the attention over the selection differs from dense
    attention)."""
    from sparsekv import LLM, SamplingParams
    from tests.conftest import random_prompt

    prompts = [random_prompt(150, seed=4), random_prompt(90, seed=5)]  # 9 and 5 full blocks: quest selects 2
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = ["device=cpu", "dtype=float32", "offload.block_size=16", "graph=eager"]
    quest = ["policy=quest", "policy.token_budget=32", "policy.dense_layers=0"]
    resident = LLM(str(qwen3_ckpt), overrides=base + quest)
    policy = resident.engine.kv_store.selection.policy
    calls = []
    select = policy.select_blocks_paged

    def spy(ctx):
        choice = select(ctx)
        rows = zip(ctx.candidates.tolist(), ctx.num_candidates.tolist(), choice.blocks.tolist(),
                   choice.counts.tolist())
        calls.append([(table[:n], sorted(blocks[:count])) for table, n, blocks, count in rows])  # per row
        return choice

    policy.select_blocks_paged = spy
    policy.select_blocks = lambda ctx: pytest.fail("a per-sequence selection in the batched path")
    got = [o.token_ids for o in resident.generate(prompts, greedy)]
    offloaded = LLM(str(qwen3_ckpt), overrides=base + quest + ["offload=cpu", "offload.num_gpu_blocks=4"])
    assert got == [o.token_ids for o in offloaded.generate(prompts, greedy)]
    assert calls and all(len(rows) == 2 for rows in calls)  # one call per layer and step, for both sequences
    for candidates, chosen in (row for rows in calls for row in rows):
        kept = candidates if len(candidates) <= 2 else candidates[:1] + candidates[-1:]  # sink and newest
        assert chosen == sorted(kept)
    dense = LLM(str(qwen3_ckpt), overrides=base).generate(prompts, greedy)
    assert got != [o.token_ids for o in dense]


@dataclass
class HostQuest(QuestPolicy):
    """Quest without its device-side batch selection: offload=none selects per sequence, eagerly."""
    name: str = "test_host_quest"
    paged_device_selection: ClassVar[bool] = False


def test_host_selecting_policy_refuses_captured_graphs_without_offload(monkeypatch):
    from sparsekv.config import GraphMode
    from sparsekv.graphs.graph_config import resolve_graph_mode

    monkeypatch.delenv("SPARSEKV_ATTN_BACKEND", raising=False)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="selects blocks per step on the host; use graph=segmented"):
        resolve_graph_mode("cudagraph", "none", cuda, HostQuest())  # checked before any CUDA call
    assert resolve_graph_mode("auto", "none", cuda, HostQuest()) == GraphMode.segmented


def test_device_selecting_policy_captures_whole_resident_steps(monkeypatch):
    """Quest chooses for the whole batch on the device (select_blocks_paged): resident steps are captured whole."""
    from sparsekv.config import GraphMode
    from sparsekv.graphs.graph_config import resolve_graph_mode

    monkeypatch.delenv("SPARSEKV_ATTN_BACKEND", raising=False)
    cuda = torch.device("cuda")
    assert QuestPolicy.paged_device_selection and QuestPolicy.decode_graph_safe
    assert resolve_graph_mode("auto", "none", cuda, QuestPolicy()) == GraphMode.cudagraph
    assert resolve_graph_mode("cudagraph", "none", cuda, QuestPolicy()) == GraphMode.cudagraph
    assert resolve_graph_mode("auto", "cpu", cuda, QuestPolicy()) == GraphMode.cudagraph
