"""vertical_slash_attention's metadata builder (sparsekv.policies.minference.vertical_slash_index) against its torch
reference, and vertical_slash_pair_count (the attention's pair counter) against the mask and an independent count.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by conftest); small sizes only.
"""
from __future__ import annotations

import math

import pytest
import torch

from sparsekv.kernels import _dispatch
from sparsekv.policies.minference import vertical_slash as vs
from sparsekv.policies.minference import vertical_slash_index as vsi
from sparsekv.policies.minference.vertical_slash import (
    vertical_slash_attention,
    vertical_slash_attention_reference,
    vertical_slash_pair_count,
    visible_pair_count,
)
from sparsekv.policies.minference.policy import SLASH_BAND, MInferencePolicy, band_offsets
from tests.conftest import CountLaunches

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BIG = 1 << 30

pytestmark = pytest.mark.usefixtures("triton_kernels")

SELECTIONS = ["random", "messy", "empty", "single", "bands", "dense", "unsorted", "int64_strided", "int32_sliced"]


def _picks(H: int, lo: int, hi: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """[H, min(count, hi - lo)] int64: sorted distinct picks from range(lo, hi) per head."""
    n = max(0, hi - lo)
    count = min(count, n)
    rows = [torch.randperm(n, generator=gen)[:count].sort().values + lo for _ in range(H)]
    return torch.stack(rows) if rows and count else torch.empty((H, 0), dtype=torch.int64)


def _selection(kind: str, H: int, Sq: int, Sk: int, q_offset: int, gen: torch.Generator):
    """(vertical_idx, slash_offsets) on DEV: int32 sorted per head unless the kind says otherwise."""
    d_hi = q_offset + Sq

    def pad(x: torch.Tensor, n: int) -> torch.Tensor:  # n sentinels at the end of each row
        return torch.cat([x, torch.full((H, n), BIG, dtype=x.dtype)], dim=1)

    if kind == "random":
        vertical = pad(_picks(H, 0, Sk, 1 + Sk // 5, gen), 3)
        slash = pad(_picks(H, 0, d_hi, 1 + d_hi // 4, gen), 2)
    elif kind == "messy":  # duplicates, negatives, entries below d_lo (hidden keys) and past the last offset
        vertical = torch.cat([torch.full((H, 2), -3), _picks(H, 0, Sk, 4, gen).repeat_interleave(2, 1),
                              torch.full((H, 2), Sk), torch.full((H, 1), Sk + 9)], 1).sort(1).values
        slash = torch.cat([torch.full((H, 1), -7), _picks(H, 0, d_hi, 6, gen).repeat_interleave(3, 1),
                           torch.full((H, 2), d_hi), torch.full((H, 1), d_hi + 100)], 1).sort(1).values
    elif kind == "empty":
        vertical, slash = torch.empty((H, 0), dtype=torch.int64), torch.empty((H, 0), dtype=torch.int64)
    elif kind == "single":  # one diagonal and one column per head (the last head: only sentinels)
        vertical = _picks(H, 0, Sk, 1, gen)
        slash = _picks(H, 0, d_hi, 1, gen)
        vertical[-1], slash[-1] = BIG, BIG
    elif kind == "bands":  # whole 64-offset bands (a gap of one band between some)
        nb = -(-d_hi // SLASH_BAND)
        slash = band_offsets(_picks(H, 0, nb, max(1, nb // 2), gen), SLASH_BAND).long()
        vertical = pad(_picks(H, 0, Sk, 3, gen), 1)
    elif kind == "dense":
        vertical = torch.arange(Sk).expand(H, -1)
        slash = torch.arange(d_hi).expand(H, -1)
    elif kind == "unsorted":  # outside the documented contract: the builder still equals the torch construction
        vertical = torch.randint(-2, Sk + 2, (H, 7), generator=gen)
        slash = torch.randint(-2, d_hi + 2, (H, 9), generator=gen)
    elif kind == "int64_strided":  # int64, every other column of a wider tensor
        vertical = pad(_picks(H, 0, Sk, 2 + Sk // 3, gen), 1).repeat_interleave(2, 1)[:, ::2]
        slash = pad(_picks(H, 0, d_hi, 2 + d_hi // 3, gen), 1).repeat_interleave(2, 1)[:, ::2]
        return vertical.to(DEV), slash.to(DEV)
    elif kind == "int32_sliced":  # int32 rows of unit stride, not contiguous (as the policy's compaction gives)
        vertical = pad(_picks(H, 0, Sk, 1 + Sk // 4, gen), 2).to(DEV, torch.int32)[:, :-1]
        slash = pad(_picks(H, 0, d_hi, 1 + d_hi // 4, gen), 2).to(DEV, torch.int32)[:, :-1]
        assert not vertical.is_contiguous() and vertical.stride(1) == 1
        return vertical, slash
    else:
        raise AssertionError(kind)
    return vertical.to(DEV, torch.int32), slash.to(DEV, torch.int32)


def pair_count_by_offsets(Sq: int, Sk: int, q_offset: int, vertical: torch.Tensor, slash: torch.Tensor
                          ) -> torch.Tensor:
    """vertical_slash_pair_count by another route, over every offset and every key: [H] int64. O(H * (Sq + Sk))
    memory, so it checks the count at sizes where the brute-force mask would not fit."""
    d_lo, d_hi = vsi.offset_range(Sq, Sk, q_offset)
    p_lo, p_hi = q_offset, q_offset + Sq - 1
    on_slash = vsi.slash_mask(slash, d_lo, d_hi).long()  # [H, W]
    selected_below = torch.nn.functional.pad(on_slash.cumsum(1), (1, 0))  # [H, W + 1]
    d = torch.arange(d_lo, d_hi, device=slash.device)
    diag_rows = (torch.minimum(torch.full_like(d, p_hi), d + Sk - 1) - torch.clamp(d, min=p_lo) + 1).clamp(min=0)
    column = vs._vertical_mask(vertical, Sk).long()  # [H, Sk]
    c = torch.arange(Sk, device=slash.device)
    col_rows = (p_hi - torch.clamp(c, min=p_lo) + 1).clamp(min=0)
    lo = (torch.clamp(p_lo - c, min=0) - d_lo).clamp(0, d_hi - d_lo)  # the offsets crossing column c in a query row
    hi = (p_hi - c + 1 - d_lo).clamp(0, d_hi - d_lo)
    crossings = (selected_below[:, hi] - selected_below[:, lo]).clamp(min=0)  # [H, Sk]
    return (on_slash * diag_rows).sum(1) + (column * col_rows).sum(1) - (column * crossings).sum(1)


def _assert_same_index(new: vsi.SlashIndex, ref: vsi.SlashIndex) -> None:
    assert new.geometry == ref.geometry
    for name in ("words", "bounds", "tlists", "ranges", "vidx"):
        a, b = getattr(new, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------------- metadata
@pytest.mark.parametrize("sq,sk,q_offset,tiles", [
    (40, 40, 0, (32, 16)),     # self-attention
    (33, 50, 17, (32, 16)),    # Sq not a multiple of BLOCK_M, q_offset not one of BLOCK_N; later keys hidden
    (19, 20, 45, (16, 16)),    # Sk < q_offset + Sq: queries past every key (d_lo > 0)
    (20, 300, 37, (64, 32)),   # keys far past the queries
    (1, 1, 0, (32, 16)),       # one query, one key
    (70, 5, 3, (64, 16)),      # four key blocks per query block
    (150, 300, 187, (128, 64)),  # three selection words per window
    (45, 130, 99, (128, 128)),   # four words
])
def test_index_matches_torch_construction(sq, sk, q_offset, tiles, monkeypatch):
    bm, bn = tiles
    H = 3
    gen = torch.Generator().manual_seed(sq * 1000 + sk + q_offset)
    ref_runs = {}
    for kind in SELECTIONS:
        vertical, slash = _selection(kind, H, sq, sk, q_offset, gen)
        ref = vsi.vertical_slash_index_reference(vertical, slash, sq, sk, q_offset, bm, bn)
        ref_runs[kind] = (vertical, slash, ref)
        # default blocks, and tiny ones so that every loop carries across blocks and grids have several programs
        _assert_same_index(vsi.vertical_slash_index(vertical, slash, sq, sk, q_offset, bm, bn), ref)
        with monkeypatch.context() as m:
            m.setattr(vsi, "MAX_BLOCKS", (64, 2, 2, 4))
            _assert_same_index(vsi.vertical_slash_index(vertical, slash, sq, sk, q_offset, bm, bn), ref)
    # the cases are not vacuous: the geometry has tiles of both kinds for some selection, empty ones stay empty
    _, _, ref = ref_runs["empty"]
    assert (ref.tlists == BIG).all() and (ref.ranges == 0).all()
    if sq * sk > 1:
        lists = torch.stack([r.tlists for _, _, r in ref_runs.values()])
        assert (lists[:, 0] < BIG).any() and (lists[:, 1] < BIG).any()


def test_index_bounds_of_windows_without_a_selected_offset():
    # offsets 5 and 90 only: windows between them hold none; their bounds are the nearest selected offsets outside
    slash = torch.tensor([[5, 90]], dtype=torch.int32, device=DEV)
    vertical = torch.zeros((1, 0), dtype=torch.int32, device=DEV)
    new = vsi.vertical_slash_index(vertical, slash, 64, 128, 64, 32, 16)
    ref = vsi.vertical_slash_index_reference(vertical, slash, 64, 128, 64, 32, 16)
    _assert_same_index(new, ref)
    g = new.geometry
    bounds = new.bounds[0].tolist()
    starts = [g.phi + (t + g.t_min - 1) * 16 + 1 for t in range(g.num_t)]
    for (first, last), start in zip(bounds, starts):
        end = start + 32 + 16 - 2
        assert first == min([o for o in (5, 90) if o >= start], default=g.d_hi)
        assert last == max([o for o in (5, 90) if o <= end], default=g.d_lo - 1)


def test_index_is_a_handful_of_launches(monkeypatch):
    names = ("_scatter_offsets_kernel", "_tile_bits_kernel", "_tile_lists_kernel", "_query_ranges_kernel")
    counters = {name: CountLaunches(getattr(vsi, name)) for name in names}
    for name, counter in counters.items():
        monkeypatch.setattr(vsi, name, counter)
    attention = CountLaunches(vs._vs_fwd_kernel)
    monkeypatch.setattr(vs, "_vs_fwd_kernel", attention)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(40, 2, 16, generator=gen).to(DEV), torch.randn(60, 1, 16, generator=gen).to(DEV)
    vertical, slash = _selection("random", 2, 40, 60, 20, gen)
    vertical_slash_attention(q, k, k, vertical, slash, 0.25, 20)
    assert {name: c.calls for name, c in counters.items()} == dict.fromkeys(names, 1) and attention.calls == 1


# ------------------------------------------------------------------------------------------- pair counter
@pytest.mark.parametrize("sq,sk,q_offset,kind", [
    (40, 40, 0, "random"),
    (33, 50, 17, "messy"),
    (19, 20, 45, "dense"),     # every key: a column and a diagonal hit the same key, counted once
    (24, 130, 80, "bands"),
    (20, 30, 0, "empty"),
    (37, 45, 3, "single"),
])
def test_pair_counter_equals_pair_count(sq, sk, q_offset, kind):
    H, KVH, D = 4, 2, 16
    gen = torch.Generator().manual_seed(sq + sk + q_offset)
    q = torch.randn(sq, H, D, generator=gen).to(DEV)
    k, v = (torch.randn(sk, KVH, D, generator=gen).to(DEV) for _ in range(2))
    vertical, slash = _selection(kind, H, sq, sk, q_offset, gen)
    expected = vertical_slash_pair_count(sq, sk, q_offset, vertical, slash)  # [H]
    per_head = torch.full((H,), 5, dtype=torch.int64, device=DEV)  # adds to what is there
    total = torch.zeros(1, dtype=torch.int64, device=DEV)
    o1, lse1 = vertical_slash_attention(q, k, v, vertical, slash, 0.3, q_offset, per_head)
    o2, lse2 = vertical_slash_attention(q, k, v, vertical, slash, 0.3, q_offset, total)
    o0, lse0 = vertical_slash_attention(q, k, v, vertical, slash, 0.3, q_offset)
    assert (per_head - 5).tolist() == expected.tolist() and total.tolist() == [expected.sum().item()]
    # counting changes nothing in the results
    for o, lse in ((o1, lse1), (o2, lse2)):
        assert torch.equal(o, o0) and torch.equal(lse, lse0)
    if kind != "empty":
        assert expected.sum() > 0
    if kind == "dense":
        assert expected.sum().item() == H * visible_pair_count(sq, sk, q_offset)


def test_pair_counter_on_the_reference_path(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_BACKEND, "torch")
    assert not _dispatch.use_triton(DEV)
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(30, 4, 16, generator=gen).to(DEV), torch.randn(50, 2, 16, generator=gen).to(DEV)
    vertical, slash = _selection("random", 4, 30, 50, 20, gen)
    expected = vertical_slash_pair_count(30, 50, 20, vertical, slash)
    per_head, total = torch.zeros(4, dtype=torch.int64, device=DEV), torch.ones(1, dtype=torch.int64, device=DEV)
    vertical_slash_attention(q, k, k, vertical, slash, 0.3, 20, per_head)
    vertical_slash_attention(q, k, k, vertical, slash, 0.3, 20, total)
    assert per_head.tolist() == expected.tolist() and total.tolist() == [1 + expected.sum().item()]


def test_pair_counter_bad_inputs_raise():
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    sel = torch.zeros((4, 2), dtype=torch.int32)
    for bad in (torch.zeros(1, dtype=torch.int32), torch.zeros(3, dtype=torch.int64),
                torch.zeros((), dtype=torch.int64), torch.zeros((4, 1), dtype=torch.int64), [0]):
        with pytest.raises(ValueError, match="pair_counter"):
            vertical_slash_attention(q, k, k, sel, sel, pair_counter=bad)


@pytest.mark.parametrize("kind", SELECTIONS)
@pytest.mark.parametrize("sq,sk,q_offset", [(40, 40, 0), (33, 50, 17), (19, 20, 45), (1, 1, 0), (24, 130, 80)])
def test_pair_count_equals_the_mask(sq, sk, q_offset, kind):
    """The closed form over the index lists against the brute-force mask and the count over every offset, on every
    kind of selection: unsorted, duplicated, negative and out-of-range entries included."""
    from tests.policies.test_minference import _brute_mask

    gen = torch.Generator().manual_seed(sq * 7 + sk + q_offset)
    vertical, slash = _selection(kind, 3, sq, sk, q_offset, gen)
    mask_pairs = _brute_mask(sq, sk, q_offset, vertical.cpu(), slash.cpu()).sum((1, 2)).tolist()
    assert vertical_slash_pair_count(sq, sk, q_offset, vertical, slash).tolist() == mask_pairs
    assert pair_count_by_offsets(sq, sk, q_offset, vertical, slash).tolist() == mask_pairs
    if kind not in ("empty", "single"):
        assert sum(mask_pairs) > 0


@pytest.mark.parametrize("sq,sk,q_offset,kind", [(33, 50, 17, "random"), (24, 130, 80, "bands"),
                                                  (40, 64, 30, "int32_sliced")])
def test_outputs_bitwise_equal_with_the_torch_metadata(sq, sk, q_offset, kind, monkeypatch):
    gen = torch.Generator().manual_seed(sq * sk)
    q = torch.randn(sq, 2, 16, generator=gen).to(DEV)
    k, v = (torch.randn(sk, 1, 16, generator=gen).to(DEV) for _ in range(2))
    vertical, slash = _selection(kind, 2, sq, sk, q_offset, gen)
    o, lse = vertical_slash_attention(q, k, v, vertical, slash, 0.3, q_offset)
    monkeypatch.setattr(vs, "vertical_slash_index", vsi.vertical_slash_index_reference)
    ro, rlse = vertical_slash_attention(q, k, v, vertical, slash, 0.3, q_offset)
    assert torch.equal(o, ro) and torch.equal(lse, rlse)
    ref_o, _ = vertical_slash_attention_reference(q, k, v, vertical, slash, 0.3, q_offset)
    assert (o - ref_o).abs().max().item() < 1e-2  # and it is the attention


# ------------------------------------------------------------------------------------------- policy density
def test_policy_density_is_the_kernel_count(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    n, S, H = 48, 96, 2
    q = torch.randn(n, H, 16, generator=gen).to(DEV)
    k, v = (torch.randn(S, 1, 16, generator=gen).to(DEV) for _ in range(2))
    densities = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv(_dispatch.ENV_BACKEND, backend)
        _dispatch._ACTIVE.clear()  # resolve the choice again under this backend
        policy = MInferencePolicy(last_q=16, vertical_size=6, slash_size=10, sink_tokens=2, recent_diagonals=4,
                                  slash_granularity=1)
        policy.compute_prefill(q, k, v, 0, 0.25)
        vertical, slash = policy.estimate_pattern(q, k, 0.25)
        kept = vertical_slash_pair_count(n, S, S - n, vertical, slash).sum().item()
        assert policy.last_density == kept / (H * visible_pair_count(n, S, S - n)) < 0.5
        densities[backend] = policy.last_density
    assert densities["triton"] == densities["torch"]


def test_chunked_policy_density_same_on_both_paths(monkeypatch):
    from tests.policies.test_minference import _chunked_prefill, _qkv

    q, k, v = _qkv(32, 96, 2, 1, 16, seed=8)
    densities = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv(_dispatch.ENV_BACKEND, backend)
        _dispatch._ACTIVE.clear()  # resolve the choice again under this backend
        policy = MInferencePolicy(last_q=8, vertical_size=6, slash_size=8, sink_tokens=2, recent_diagonals=3,
                                  slash_granularity=1)
        _chunked_prefill(policy, q, k, v, 64, 16, 0.25, slots=2)
        densities[backend] = policy.last_density
    assert 0.0 < densities["triton"] == densities["torch"] < 0.8


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "bands"])
def test_gpu_index_and_counter_at_128k(kind):
    H, Sq, Sk, D = 32, 8192, 131072, 128
    gen = torch.Generator().manual_seed(0)
    if kind == "random":
        vertical = _picks(H, 0, Sk, 1000, gen)
        slash = torch.cat([torch.arange(100).expand(H, -1), _picks(H, 100, Sk, 6000, gen)], 1)
    else:
        vertical = _picks(H, 0, Sk, 1000, gen)
        slash = band_offsets(_picks(H, 0, Sk // SLASH_BAND, 96, gen), SLASH_BAND).long()
    vertical, slash = vertical.to(DEV, torch.int32), slash.to(DEV, torch.int32)
    for bm, bn in ((64, 32), (64, 64)):
        _assert_same_index(vsi.vertical_slash_index(vertical, slash, Sq, Sk, Sk - Sq, bm, bn),
                           vsi.vertical_slash_index_reference(vertical, slash, Sq, Sk, Sk - Sq, bm, bn))
    q = torch.randn(Sq, H, D, generator=gen).to(DEV, torch.bfloat16)
    k, v = (torch.randn(Sk, 8, D, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    counter = torch.zeros(H, dtype=torch.int64, device=DEV)
    o, lse = vertical_slash_attention(q, k, v, vertical, slash, 1 / math.sqrt(D), Sk - Sq, counter)
    assert counter.tolist() == pair_count_by_offsets(Sq, Sk, Sk - Sq, vertical, slash).tolist()
    o0, lse0 = vertical_slash_attention(q, k, v, vertical, slash, 1 / math.sqrt(D), Sk - Sq)
    assert torch.equal(o, o0) and torch.equal(lse, lse0)
