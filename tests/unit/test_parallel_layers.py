"""Tensor-parallel layers on 2 gloo ranks (device=cpu) against their unsharded counterparts: each rank builds its
shard from the same full weights, runs it, and the ranks' largest error is reduced to rank 0."""
from __future__ import annotations

import pytest
import torch

from sparsekv.distributed.sharding import Shard, head_shards
from sparsekv.kernels.backend import resolve_kernels


IN, OUT, ROWS = 24, 20, 3


@pytest.fixture(scope="module")
def ranks():
    from sparsekv.distributed.launch import driver_ranks

    return driver_ranks(2, "cpu")


def _weights(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _max_error(tp, error: float) -> float:
    t = torch.tensor([error])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=tp.group)
    return float(t)


def column_parallel_error(tp, bias: bool) -> float:
    """Packed (two parts) column-parallel output vs the matching rows of the full linear's output."""
    from sparsekv.layers.linear import ColumnParallelLinear

    kernels = resolve_kernels("cpu")
    weight, b, x = _weights(2 * OUT, IN, seed=1), _weights(2 * OUT, seed=2), _weights(ROWS, IN, seed=3)
    full = torch.nn.functional.linear(x, weight, b if bias else None)  # [ROWS, 2 * OUT]
    per = OUT // tp.size
    part = Shard(0, tp.rank * per, per, OUT)
    layer = ColumnParallelLinear(IN, [part, part], bias=bias, kernels=kernels)
    with torch.no_grad():
        for index in range(2):
            rows = slice(index * OUT + part.start, index * OUT + part.stop)
            layer.weight[index * per:(index + 1) * per] = weight[rows]
            if bias:
                layer.bias[index * per:(index + 1) * per] = b[rows]
        out = layer(x)
    expected = torch.cat([full[:, i * OUT + part.start:i * OUT + part.stop] for i in range(2)], dim=-1)
    return _max_error(tp, float((out - expected).abs().max()))


def row_parallel_error(tp, bias: bool) -> float:
    from sparsekv.layers.linear import RowParallelLinear

    kernels = resolve_kernels("cpu")
    weight, b, x = _weights(OUT, IN, seed=4), _weights(OUT, seed=5), _weights(ROWS, IN, seed=6)
    full = torch.nn.functional.linear(x, weight, b if bias else None)  # [ROWS, OUT]
    per = IN // tp.size
    shard = Shard(0, tp.rank * per, per, IN)
    layer = RowParallelLinear(shard, OUT, bias=bias, kernels=kernels, tp=tp)
    with torch.no_grad():
        layer.weight.copy_(weight[:, shard.start:shard.stop])
        if bias:
            layer.bias.copy_(b)
        out = layer(x[:, shard.start:shard.stop])
    return _max_error(tp, float((out - full).abs().max()))


def vocab_parallel_error(tp, vocab: int) -> float:
    """Embedding lookups and LM-head logits over a vocabulary split in padded slices."""
    from sparsekv.layers.embedding import VocabParallelEmbedding
    from sparsekv.layers.linear import ParallelLMHead

    table, ids, hidden = _weights(vocab, IN, seed=7), torch.arange(vocab).flip(0), _weights(ROWS, IN, seed=8)
    embed = VocabParallelEmbedding(vocab, IN, tp=tp)
    head = ParallelLMHead(IN, vocab, kernels=resolve_kernels("cpu"), tp=tp)
    with torch.no_grad():
        real = embed.shard.stop - embed.shard.start
        embed.weight.zero_()
        embed.weight[:real] = table[embed.shard.start:embed.shard.stop]
        head.weight = embed.weight  # tied, as a tie_word_embeddings checkpoint
        errors = [(embed(ids) - table[ids]).abs().max(), (head(hidden) - hidden @ table.T).abs().max()]
    return _max_error(tp, float(max(errors)))


@pytest.mark.parametrize("bias", [False, True])
def test_column_parallel_linear_equals_unsharded(ranks, bias):
    assert ranks.call(column_parallel_error, bias) < 1e-5


@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_linear_equals_unsharded(ranks, bias):
    assert ranks.call(row_parallel_error, bias) < 1e-5


@pytest.mark.parametrize("vocab", [16, 17])  # 17: the last rank's slice is padded
def test_vocab_parallel_embedding_and_lm_head_equal_unsharded(ranks, vocab):
    assert ranks.call(vocab_parallel_error, vocab) < 1e-5


@pytest.mark.parametrize("heads, kv_heads, size, expected", [
    (8, 4, 2, [(4, 2, 0, 0), (4, 2, 4, 2)]),
    (8, 2, 4, [(2, 1, 0, 0), (2, 1, 2, 0), (2, 1, 4, 1), (2, 1, 6, 1)]),  # KV heads replicated on 2 ranks each
])
def test_head_shards(heads, kv_heads, size, expected):
    got = [head_shards(heads, kv_heads, rank, size) for rank in range(size)]
    assert [(s.num_heads, s.num_kv_heads, s.first_head, s.first_kv_head) for s in got] == expected
    group = heads // kv_heads
    for s in got:  # every query head of a rank reads the rank's KV heads
        assert s.first_head // group >= s.first_kv_head
        assert (s.first_head + s.num_heads - 1) // group < s.first_kv_head + s.num_kv_heads
