"""Quest's fused block-score kernel (sparsekv/policies/quest/quest_score.py) against its pure-torch reference, and the
reference against QuestPolicy's general (multi-query) scoring it replaces in decode.

On CPU the kernel runs under the Triton interpreter (the triton_kernels fixture)."""
from __future__ import annotations

import pytest
import torch

from sparsekv.policies.quest import quest_score
from sparsekv.policies.quest.quest_score import (
    quest_block_shares,
    quest_block_shares_reference,
    quest_select,
    quest_select_reference,
)
from sparsekv.policies.context import KVLayout
from sparsekv.policies.quest import QuestPolicy

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(heads: int, kv_heads: int, dim: int, blocks: int, n: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, dim, generator=g).to(DEV, dtype)
    lo = torch.randn(blocks, kv_heads, dim, generator=g)
    hi = lo + torch.rand(blocks, kv_heads, dim, generator=g) * 2  # kmax >= kmin
    ids = torch.randperm(blocks, generator=g)[:n].to(DEV)
    return q, hi.to(DEV, dtype), lo.to(DEV, dtype), ids


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("heads,kv_heads,dim,blocks,n", [
    (4, 4, 32, 8, 1), (8, 2, 32, 40, 17), (8, 1, 64, 50, 50), (6, 2, 16, 30, 9)])
def test_kernel_matches_reference(heads, kv_heads, dim, blocks, n, monkeypatch):
    calls = []
    kernel = quest_score._quest_shares_kernel
    monkeypatch.setattr(quest_score, "_quest_shares_kernel",
                        type("Spy", (), {"__getitem__": lambda _, grid: (calls.append(grid), kernel[grid])[1]})())
    q, hi, lo, ids = _inputs(heads, kv_heads, dim, blocks, n, seed=n + dim)
    out = quest_block_shares(q, hi, lo, ids, dim ** -0.5)
    assert calls, "the Triton kernel did not run"
    ref = quest_block_shares_reference(q, hi, lo, ids, dim ** -0.5)
    assert out.shape == (kv_heads, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.all(out > 0) and torch.all(out <= 1)


def test_reference_equals_policy_scores():
    """One decode query: the per-KV-head shares summed equal QuestPolicy's multi-query score path."""
    heads, kv_heads, dim, blocks = 8, 2, 16, 12
    q, hi, lo, ids = _inputs(heads, kv_heads, dim, blocks, 9, seed=3)
    policy = QuestPolicy(token_budget=2)
    policy.initialize(KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, block_size=16, max_blocks=blocks,
                               dtype=torch.float32, device=DEV))
    for block in range(blocks):
        policy._kmax.write(0, block, hi[block])
        policy._kmin.write(0, block, lo[block])
    bound = policy.upper_bounds(q[None], ids, 0)  # [n, 1, KVH, G]: the general path
    general = torch.softmax(bound * dim ** -0.5, dim=0).amax(dim=3).sum(dim=(1, 2))
    fused = quest_block_shares_reference(q, policy._kmax.data[0], policy._kmin.data[0], ids, dim ** -0.5).sum(0)
    torch.testing.assert_close(fused, general, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(policy.block_scores(q[None], ids, 0), general, rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused():
    q, hi, lo, ids = _inputs(8, 2, 16, 4, 3, seed=0)
    with pytest.raises(ValueError, match="expected q"):
        quest_block_shares(q[None], hi, lo, ids, 1.0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        four = torch.zeros(4, 4, 16, device=DEV)
        quest_block_shares(q[:6], four, four, ids, 1.0)
    with pytest.raises(ValueError, match="int64"):
        quest_block_shares(q, hi, lo, ids.int(), 1.0)


@pytest.mark.gpu
@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("n", [1, 2, 127, 128, 1000])
def test_gpu_kernel_real_sizes(n):
    q, hi, lo, ids = _inputs(32, 8, 128, 1024, n, seed=n, dtype=torch.bfloat16)
    out = quest_block_shares(q, hi, lo, ids, 128 ** -0.5)
    ref = quest_block_shares_reference(q, hi, lo, ids, 128 ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-6)
    if n > 4:  # the one-launch choice (4 blocks: Qwen3-4B's 4096-token budget at block size 1024)
        _assert_same_choice(quest_select(q, hi, lo, ids, 128 ** -0.5, 4), q, hi, lo, ids, 128 ** -0.5, 4)


@pytest.mark.gpu
@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("n,keep", [(4096, 4), (4096, 64), (16384, 4), (16384, 32)])
def test_gpu_select_many_candidates(n, keep):
    """Up to SELECT_MAX_CANDIDATES: the last program's partial-softmax and score tiles loop over many chunks."""
    q, hi, lo, ids = _inputs(32, 8, 128, n, n, seed=n + keep, dtype=torch.bfloat16)
    _assert_same_choice(quest_select(q, hi, lo, ids, 128 ** -0.5, keep), q, hi, lo, ids, 128 ** -0.5, keep)


def _assert_same_choice(chosen, q, hi, lo, ids, scale, keep):
    """Sink and newest first, then the same middle blocks as the reference. The inputs must not put two scores at
    the cut within float rounding of each other (asserted), so that any correct kernel makes the same choice."""
    assert chosen.dtype == torch.int64 and chosen.shape == (keep,)
    assert chosen[:2].tolist() == [ids[0].item(), ids[-1].item()]
    middle = quest_block_shares_reference(q, hi, lo, ids, scale).sum(0)[1:-1].sort(descending=True).values
    if keep > 2:
        assert middle[keep - 3] - middle[keep - 2] > 1e-4 * middle[0], "near tie at the cut: pick another seed"
    assert sorted(chosen.tolist()) == sorted(quest_select_reference(q, hi, lo, ids, scale, keep).tolist())


def _spy_select(monkeypatch) -> list:
    """The grids quest_select launches its kernel with: empty when the reference ran instead."""
    calls = []
    kernel = quest_score._quest_select_kernel
    monkeypatch.setattr(quest_score, "_quest_select_kernel",
                        type("Spy", (), {"__getitem__": lambda _, grid: (calls.append(grid), kernel[grid])[1]})())
    return calls


def _select_grid(kv_heads: int, n: int, rows: int = 1) -> tuple[int, int, int]:
    return kv_heads, -(-n // quest_score._block_b()), rows


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("heads,kv_heads,dim,blocks,n,keep", [
    (4, 4, 16, 12, 3, 2),  # GQA 1, fewer candidates than one bound tile, one score tile
    (8, 4, 32, 20, 8, 3),  # GQA 2, exactly one bound tile, two score tiles
    (8, 2, 16, 30, 16, 15),  # GQA 4, exactly two bound tiles, keep = n - 1
    (8, 2, 64, 60, 27, 5),  # three bound tiles and a remainder
    (4, 4, 32, 40, 19, 18),  # GQA 1, two tiles and a remainder, keep = n - 1
    (2, 1, 16, 30, 13, 4),  # one KV head, two bound tiles, one score tile
    (12, 3, 32, 40, 21, 6),  # 3 KV heads (padded to 4)
    (6, 2, 16, 30, 9, 8),  # GQA 3 (padded to 4)
    (8, 2, 32, 40, 17, 5),
    (8, 1, 64, 50, 50, 2),
    (8, 1, 64, 80, 70, 4),  # GQA 8, nine bound tiles: the partial softmax max/sum combined over three chunks
    (32, 8, 128, 140, 127, 4),  # Qwen3-4B's heads
])
def test_select_kernel_matches_reference(heads, kv_heads, dim, blocks, n, keep, monkeypatch):
    calls = _spy_select(monkeypatch)
    q, hi, lo, ids = _inputs(heads, kv_heads, dim, blocks, n, seed=n + keep)
    chosen = quest_select(q, hi, lo, ids, dim ** -0.5, keep)
    assert calls == [_select_grid(kv_heads, n)], "the Triton kernel did not run"
    _assert_same_choice(chosen, q, hi, lo, ids, dim ** -0.5, keep)


@pytest.mark.usefixtures("triton_kernels")
def test_select_kernel_resets_its_counter(monkeypatch):
    """The last program of each launch zeroes the shared counter, so launches of any grid follow one another."""
    calls = _spy_select(monkeypatch)
    cases = [(8, 2, 32, 40, 27, 5, 1), (8, 4, 16, 20, 9, 3, 2), (8, 2, 32, 40, 27, 5, 1), (4, 1, 16, 30, 30, 7, 3)]
    for heads, kv_heads, dim, blocks, n, keep, seed in cases:
        q, hi, lo, ids = _inputs(heads, kv_heads, dim, blocks, n, seed=seed)
        _assert_same_choice(quest_select(q, hi, lo, ids, dim ** -0.5, keep), q, hi, lo, ids, dim ** -0.5, keep)
        assert not quest_score._COUNTERS[q.device].any()
    assert calls == [_select_grid(kv_heads, n) for _, kv_heads, _, _, n, _, _ in cases]


def test_select_refuses_a_budget_outside_the_candidates():
    q, hi, lo, ids = _inputs(8, 2, 16, 10, 6, seed=0)
    with pytest.raises(ValueError, match="keep=6 must be at least 2 and below the 6 candidates"):
        quest_select(q, hi, lo, ids, 1.0, 6)
    with pytest.raises(ValueError, match="keep=1"):
        quest_select(q, hi, lo, ids, 1.0, 1)


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (6, 3, 16), (4, 4, 32)])
def test_row_scores_are_each_rows_single_query_shares(heads, kv_heads, dim):
    """Rows of candidates scored at once: each row's own count (rows of 0 (padding), 1 and every column), ids past a
    row's count ignored (out of range here), -inf outside each row's middle, and each row's middle the shares one
    query gets alone."""
    from sparsekv.policies.quest.row_select import quest_row_scores

    g = torch.Generator().manual_seed(dim)
    blocks, width, counts = 40, 19, [19, 0, 5, 1, 12]
    lo = torch.randn(blocks, kv_heads, dim, generator=g)
    hi = (lo + torch.rand(blocks, kv_heads, dim, generator=g) * 2).to(DEV)
    lo = lo.to(DEV)
    q = torch.randn(len(counts), heads, dim, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in counts]).to(DEV)
    num = torch.tensor(counts, device=DEV)
    for row, n in enumerate(counts):
        ids[row, n:] = 10 ** 6  # past the count: never a candidate
    got = quest_row_scores(q, hi, lo, ids, num, dim ** -0.5)
    assert got.isinf().sum() == sum(width - max(n - 2, 0) for n in counts)
    for row, n in enumerate(counts):
        assert got[row, :n][1:n - 1].isfinite().all() and got[row, n:].isinf().all()
        if n > 2:  # one query's shares, summed over the KV heads: the single-row kernel's reference
            single = quest_block_shares_reference(q[row], hi, lo, ids[row, :n], dim ** -0.5).sum(dim=0)
            torch.testing.assert_close(got[row, 1:n - 1], single[1:n - 1], atol=1e-6, rtol=1e-5)


def _rows(heads: int, kv_heads: int, dim: int, blocks: int, counts: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    lo = torch.randn(blocks, kv_heads, dim, generator=g)
    hi = (lo + torch.rand(blocks, kv_heads, dim, generator=g) * 2).to(DEV)
    q = torch.randn(len(counts), heads, dim, generator=g).to(DEV)
    width = max(counts)
    ids = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in counts]).to(DEV)
    for row, n in enumerate(counts):
        ids[row, n:] = -1  # padding past each row's count, as the offloaded batch pads
    return q, hi, lo.to(DEV), ids, torch.tensor(counts, device=DEV)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("heads,kv_heads,dim,blocks,counts,keep", [
    (8, 2, 32, 60, [27, 9, 27, 14], 5),  # rows of different lengths: later bound tiles empty for the short rows
    (4, 4, 16, 40, [19, 3], 2),  # keep 2: the sink and the newest only
    (12, 3, 32, 80, [70, 41, 70], 6),  # 3 KV heads, partial maxima combined over several chunks
    (8, 1, 64, 30, [12], 4),  # one row
])
def test_row_select_kernel_matches_each_rows_single_choice(heads, kv_heads, dim, blocks, counts, keep, monkeypatch):
    """One launch over the rows chooses, for each row, what quest_select chooses for that row's query alone, and the
    torch reference of the rows agrees; every row's counter is back at 0 afterwards."""
    from sparsekv.policies.quest.row_select import quest_select_rows, quest_select_rows_reference

    calls = _spy_select(monkeypatch)
    q, hi, lo, ids, num = _rows(heads, kv_heads, dim, blocks, counts, seed=sum(counts) + keep)
    chosen = quest_select_rows(q, hi, lo, ids, num, dim ** -0.5, keep)
    assert calls == [_select_grid(kv_heads, max(counts), len(counts))], "the kernel did not run"
    assert chosen.shape == (len(counts), keep) and chosen.dtype == ids.dtype
    reference = quest_select_rows_reference(q, hi, lo, ids, num, dim ** -0.5, keep)
    for row, n in enumerate(counts):
        _assert_same_choice(chosen[row], q[row], hi, lo, ids[row, :n], dim ** -0.5, keep)
        assert sorted(reference[row].tolist()) == sorted(chosen[row].tolist())
    assert not quest_score._COUNTERS[q.device][:len(counts)].any()


@pytest.mark.usefixtures("triton_kernels")
def test_row_select_kernel_tolerates_rows_too_short_to_select():
    """The resident store passes every row of the batch; rows with fewer candidates than the budget (even none) get
    ids the caller ignores, without reading outside their row or disturbing the other rows' choices."""
    from sparsekv.policies.quest.row_select import quest_select_rows

    counts, keep = [25, 0, 3, 25], 4
    q, hi, lo, ids, num = _rows(8, 2, 32, 50, counts, seed=3)
    chosen = quest_select_rows(q, hi, lo, ids, num, 32 ** -0.5, keep)
    for row in (0, 3):
        _assert_same_choice(chosen[row], q[row], hi, lo, ids[row], 32 ** -0.5, keep)
    assert chosen[2, :2].tolist() == [ids[2, 0].item(), ids[2, 2].item()]  # the sink and the newest of 3
    assert not quest_score._COUNTERS[q.device][:len(counts)].any()


@pytest.mark.gpu
@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("counts", [[480, 480, 452, 480, 300, 480], [4096] * 3 + [17]])
def test_gpu_row_select_real_sizes(counts):
    """Llama-3.1-8B's heads, a 2,048-token budget of 256-token blocks over rows as a decode batch has them."""
    from sparsekv.policies.quest.row_select import quest_select_rows

    q, hi, lo, ids, num = _rows(32, 8, 128, 5000, counts, seed=len(counts))
    chosen = quest_select_rows(q.bfloat16(), hi.bfloat16(), lo.bfloat16(), ids, num, 128 ** -0.5, 8)
    for row, n in enumerate(counts):
        _assert_same_choice(chosen[row], q[row].bfloat16(), hi.bfloat16(), lo.bfloat16(), ids[row, :n],
                            128 ** -0.5, 8)
