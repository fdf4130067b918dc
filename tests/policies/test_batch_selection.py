"""A batch's decode selection in one policy call (select_blocks_batch) chooses what per-sequence calls choose.

(a) Quest's batched choice equals its per-sequence choice as sets, for sequences of different lengths (some dense,
    some selecting) on random metadata and queries;
(b) the default hook loops over select_blocks; checked_selections validates each choice like checked_selection.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from sparsekv.policies.context import PolicySelectionError
from sparsekv.policies.quest import QuestPolicy
from sparsekv.policies.scorer import ScorerPolicy
from tests.conftest import host_sync_sites
from tests.policies.test_policies import make_ctx, make_layout

LAYERS, KV_HEADS, HEADS, DIM, BS = 3, 2, 4, 16, 16
READER = SimpleNamespace(check_selections=True)


def quest_with_metadata(seed: int, num_blocks: int, **fields) -> QuestPolicy:
    gen = torch.Generator().manual_seed(seed)
    policy = QuestPolicy(**fields)
    policy.initialize(make_layout(LAYERS, KV_HEADS, DIM, BS))
    for block in range(num_blocks):
        keys = torch.randn(BS, KV_HEADS, DIM, generator=gen)
        for layer in range(LAYERS):
            policy.on_prefill_offload(block, layer, keys, BS)
    return policy


def batch_contexts(seed: int, layer: int, lengths: list[int], num_blocks: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    ctxs = []
    for n in lengths:
        blocks = torch.randperm(num_blocks, generator=gen)[:n].sort().values.tolist()
        query = torch.randn(1, HEADS, DIM, generator=gen)
        ctxs.append(make_ctx("decode", layer, query, blocks, BS, (n + 1) * BS - 3))
    return ctxs


def as_set(selection) -> set[int] | None:
    return None if selection is None else set(torch.as_tensor(selection).tolist())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quest_batch_equals_per_sequence_as_sets(seed):
    policy = quest_with_metadata(seed, 60, topk_blocks=5, threshold_blocks=3, dense_layers=1)
    lengths = [2, 4, 5, 6, 9, 30, 17]  # <= threshold, <= keep (dense), then selecting rows of different lengths
    for layer in range(LAYERS):
        ctxs = batch_contexts(seed + 10 * layer, layer, lengths, 60)
        batched = policy.select_blocks_batch(ctxs)
        single = [policy.select_blocks(ctx) for ctx in ctxs]
        assert len(batched) == len(ctxs)
        assert [as_set(s) for s in batched] == [as_set(s) for s in single]
        selecting = [s for s in batched if s is not None]
        assert len(selecting) == (0 if layer < 1 else 4)
        assert all(s.shape == (5,) and s.dtype == torch.int64 for s in selecting)
        checked = policy.checked_selections(ctxs, READER)  # device values checked: candidates, no duplicates
        assert [set(torch.as_tensor(c).tolist()) for c in checked] == \
            [set(ctx.candidates) if s is None else as_set(s) for ctx, s in zip(ctxs, single)]


def test_quest_batch_keeps_sink_and_newest_against_the_scores():
    policy = quest_with_metadata(3, 40, topk_blocks=3, dense_layers=0)
    ctxs = batch_contexts(4, 1, [12, 7, 20], 40)
    for ctx in ctxs:  # make the sink and the newest block the least attractive
        for block in (ctx.candidates[0], ctx.candidates[-1]):
            policy.on_prefill_offload(block, 1, torch.zeros(BS, KV_HEADS, DIM), BS)
    for ctx, selection in zip(ctxs, policy.select_blocks_batch(ctxs)):
        chosen = as_set(selection)
        assert {ctx.candidates[0], ctx.candidates[-1]} <= chosen and len(chosen) == 3
        assert chosen <= set(ctx.candidates)


@dataclass
class NormScorer(ScorerPolicy):
    """Scores each candidate by the query's norm times its block id: deterministic, depends on the context."""
    name: str = "norm_scorer"

    def score_blocks(self, ctx):
        return ctx.candidate_ids.float() * ctx.query.float().norm()


def test_default_hook_loops_over_select_blocks():
    policy = NormScorer(token_budget=3 * BS)
    ctxs = batch_contexts(5, 0, [2, 3, 8, 11], 50)
    batched = policy.select_blocks_batch(ctxs)
    assert [as_set(s) for s in batched] == [as_set(policy.select_blocks(ctx)) for ctx in ctxs]
    assert batched[0] is None and batched[1] is None
    checked = policy.checked_selections(ctxs, READER)
    assert list(checked[0]) == ctxs[0].candidates and as_set(checked[2]) == as_set(batched[2])


@dataclass
class BadBatch(ScorerPolicy):
    name: str = "bad_batch"
    result: object = None

    def select_blocks_batch(self, ctxs):
        return self.result


@pytest.mark.parametrize("result, message", [
    ([None], "select_blocks_batch: returned 1 selections for 2 contexts"),
    (None, "select_blocks_batch: returned NoneType selections for 2 contexts"),
    ([None, [999]], "BadBatch.select_blocks (layer 0, decode, 3 candidates): block id 999 is not a candidate"),
    ([None, torch.tensor([7, 7])], "is selected twice"),
])
def test_checked_selections_name_the_policy_and_the_bad_value(result, message):
    ctxs = batch_contexts(6, 0, [4, 3], 50)
    if isinstance(result, list) and isinstance(result[-1], torch.Tensor):
        result[-1] = torch.tensor([ctxs[1].candidates[0]] * 2)
    with pytest.raises(PolicySelectionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BadBatch(result=result).checked_selections(ctxs, READER)


@pytest.mark.gpu
def test_gpu_quest_batch_does_not_sync():
    dev = torch.device("cuda")
    policy = QuestPolicy(topk_blocks=4, dense_layers=0)
    policy.initialize(make_layout(1, KV_HEADS, DIM, BS, torch.bfloat16, dev))
    for block in range(64):
        policy.on_prefill_offload(block, 0, torch.randn(BS, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16), BS)
    queries = torch.randn(3, HEADS, DIM, device=dev, dtype=torch.bfloat16)
    cached: dict[tuple, torch.Tensor] = {}  # one device copy per id list, as the store's ids_source keeps them

    def ids_source(blocks):
        key = tuple(blocks)
        if key not in cached:  # setdefault would build (and copy) a new tensor on every call
            cached[key] = torch.tensor(list(blocks), device=dev)
        return cached[key]

    def contexts():
        return [replace(make_ctx("decode", 0, queries[b:b + 1], list(range(b, 20 + 10 * b)), BS, 64 * BS),
                        ids_source=ids_source) for b in range(3)]

    policy.select_blocks_batch(contexts())  # warm: the padded id list reaches the device
    assert host_sync_sites(lambda: policy.select_blocks_batch(contexts())) == []
