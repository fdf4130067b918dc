"""offload=none, Quest's batched device-side selection (sparsekv.kvcache.paged_batch_selection) against the
per-sequence path it replaces: the same attention over a mixed batch (rows that select, rows at or below
threshold_blocks, a row whose unfinished block is full, a padding row of a captured batch), through the paged kernel
(Triton under the interpreter on CPU)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sparsekv.engine.context import Context
from sparsekv.kvcache.paged import PagedKVStore
from sparsekv.policies.context import PagedChoice, PolicySelectionError
from sparsekv.policies.full import FullAttentionPolicy
from sparsekv.policies.quest import QuestPolicy

BLOCK, LAYERS, BLOCKS, KV_HEADS, HEADS, DIM = 4, 2, 24, 2, 4, 16
# 7 full blocks (selects), 3 (below threshold), 5 with a full unfinished block (selects), 4 (at the threshold)
LENGTHS = (30, 13, 24, 19)


@dataclass
class FakeSeq:
    block_table: list[int]
    length: int

    def __len__(self) -> int:
        return self.length


def _store(check_selections: bool = False) -> PagedKVStore:
    policy = QuestPolicy(token_budget=3 * BLOCK, threshold_blocks=4, dense_layers=1)  # keep 3 blocks of > 4
    store = PagedKVStore(LAYERS, BLOCKS, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"),
                         FullAttentionPolicy(), max_model_len=64, decode_policy=policy,
                         check_selections=check_selections)
    gen = torch.Generator().manual_seed(0)
    store.k_cache.copy_(torch.randn(store.k_cache.shape, generator=gen))
    store.v_cache.copy_(torch.randn(store.v_cache.shape, generator=gen))
    return store


def _batch(store: PagedKVStore, padding_rows: int = 1) -> tuple[torch.Tensor, Context]:
    """q [B, H, D] and the decode Context of LENGTHS plus padding rows (context length 0, stale table entries), the
    sequences' blocks recorded by the policy's prefill hook."""
    free = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    seqs = []
    for length in LENGTHS:
        table = [free.pop() for _ in range(-(-length // BLOCK))]
        seqs.append(FakeSeq(table, length))
        for layer in range(LAYERS):
            for index, block in enumerate(table):
                n = min(BLOCK, length - index * BLOCK)
                store.selection.policy.on_prefill_offload(block, layer, store.k_cache[layer, block, :n], n)
    rows = len(seqs) + padding_rows
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
                          + [seqs[0].block_table[:width]] * padding_rows, dtype=torch.int32)  # [B, W]
    lens = torch.tensor(list(LENGTHS) + [0] * padding_rows, dtype=torch.int32)
    q = torch.randn(rows, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    return q, Context(is_prefill=False, kv_store=store, seqs=seqs, block_tables=tables, context_lens=lens,
                      max_context_len=max(LENGTHS))


def _attend(store: PagedKVStore, layer: int, q: torch.Tensor, context: Context, batched: bool):
    store.selection.batched = batched
    return store.selection.attend(layer, q, store.k_cache[layer], store.v_cache[layer], DIM ** -0.5, context)


def test_batched_selection_attends_like_the_per_sequence_path():
    from sparsekv.kernels import paged_decode_attention

    store = _store()
    q, padded = _batch(store)
    real = len(LENGTHS)
    unpadded = Context(is_prefill=False, kv_store=store, seqs=padded.seqs, block_tables=padded.block_tables[:real],
                       context_lens=padded.context_lens[:real], max_context_len=max(LENGTHS))
    assert _attend(store, 0, q, padded, True) is None and _attend(store, 0, q[:real], unpadded, False) is None
    batched, per_sequence = _attend(store, 1, q, padded, True), _attend(store, 1, q[:real], unpadded, False)
    torch.testing.assert_close(batched[:real], per_sequence, atol=1e-5, rtol=1e-5)
    full, _ = paged_decode_attention(q[:real], store.k_cache[1], store.v_cache[1], unpadded.block_tables,
                                     unpadded.context_lens, DIM ** -0.5, max_context_len=max(LENGTHS))
    changed = (batched[:real] - full).abs().amax(dim=(1, 2)) > 1e-4
    assert changed.tolist() == [True, False, True, False]  # only the selecting rows attend fewer blocks


def test_batched_choice_keeps_sink_newest_and_every_block_of_short_rows():
    store = _store()
    q, context = _batch(store, padding_rows=2)
    policy, seen = store.selection.policy, []
    select = policy.select_blocks_paged

    def spy(ctx):
        choice = select(ctx)
        seen.append((ctx, choice))
        return choice

    policy.select_blocks_paged = spy
    _attend(store, 1, q, context, True)
    (ctx, choice), = seen
    assert ctx.num_candidates.tolist() == [7, 3, 5, 4, 0, 0]
    assert choice.blocks.shape == (6, 4)  # C = max(keep 3, threshold 4): the kernel plans for 5 blocks
    assert choice.counts.tolist() == [3, 3, 3, 4, 0, 0]
    for row, seq in enumerate(context.seqs):
        full = seq.block_table[:(len(seq) - 1) // BLOCK]
        chosen = choice.blocks[row, :choice.counts[row]].tolist()
        if len(full) > 4:
            assert chosen[:2] == [full[0], full[-1]] and set(chosen) <= set(full) and len(set(chosen)) == 3
        else:
            assert chosen == full


def test_checked_batched_choices_and_a_bad_one():
    store = _store(check_selections=True)
    q, context = _batch(store)
    assert _attend(store, 1, q, context, True) is not None  # Quest's choices pass the synced validation
    policy = store.selection.policy
    good = policy.select_blocks_paged
    policy.select_blocks_paged = lambda ctx: PagedChoice(good(ctx).blocks + BLOCKS, good(ctx).counts)
    with pytest.raises(PolicySelectionError, match=r"QuestPolicy.select_blocks_paged \(layer 1, batch 5\): row 0"):
        _attend(store, 1, q, context, True)
    policy.select_blocks_paged = lambda ctx: [1, 2]
    with pytest.raises(PolicySelectionError, match="expected None or a PagedChoice"):
        _attend(store, 1, q, context, True)
