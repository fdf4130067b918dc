"""MInference (vertical-slash) policy and its kernel.

On CPU the Triton kernel runs under the interpreter (TRITON_INTERPRET=1, set by conftest; the `triton_kernels`
fixture asks for the Triton kernels in every test here, so the policy and engine tests go through the interpreted
kernels too). The interpreter
mishandles bf16 tl.dot, so CPU tests use fp32; bf16 at realistic size is the GPU test at the end.
"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.kernels import _dispatch, flash_attn_with_lse_reference
from sparsekv.policies.minference.vertical_slash import (
    vertical_slash_attention,
    vertical_slash_attention_reference,
    vertical_slash_pair_count,
)
from sparsekv.policies.minference import vertical_slash_estimate as estimate
from sparsekv.policies.minference.vertical_slash_estimate import (
    last_rows_lse,
    last_rows_lse_reference,
    vertical_slash_masses,
    vertical_slash_masses_reference,
)
from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.sizing import check_whole_prompt_room, prefill_step_tokens
from sparsekv.kvcache.reader import RingReader
from sparsekv.policies.context import PolicyContext
from sparsekv.policies.full import FullAttentionPolicy
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.policies.minference.policy import SLASH_BAND, MInferencePolicy
from sparsekv.policies.minference.selection import band_offsets, band_sums, compact, top_indices
from tests.conftest import growing_row_maxima, random_prompt

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the masses kernels' float32 dots run as TF32 on CUDA (scores off by ~3e-4 relative, up to ~4e-3 once exponentiated
# against a fixed normaliser), exact float32 under the interpreter
TOL = {"rtol": 1e-2, "atol": 1e-4} if DEV.type == "cuda" else {"rtol": 1e-4, "atol": 1e-5}
EXACT = 3e-3 if DEV.type == "cuda" else 1e-5  # relative error of "exact" results (tf32 tl.dot on the GPU)
CPU = ["device=cpu", "dtype=float32"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
FULL_BUDGET = ["policy=minference", "policy.vertical_size=100000", "policy.slash_size=100000"]


pytestmark = pytest.mark.usefixtures("triton_kernels")


@pytest.fixture
def sparse_path(monkeypatch):
    """Full budgets run the sparse path too (by default they take the dense shortcut)."""
    monkeypatch.setattr(MInferencePolicy, "dense_when_all_kept", False)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _random_selection(H: int, n: int, count: int, gen: torch.Generator, pad: int = 0) -> torch.Tensor:
    """[H, count + pad] sorted int32 picks from range(n), padded at the end with out-of-range sentinels."""
    rows = [torch.randperm(n, generator=gen)[:count].sort().values for _ in range(H)]
    sel = torch.stack(rows) if count else torch.empty((H, 0), dtype=torch.int64)
    if pad:
        sel = torch.cat([sel, torch.full((H, pad), 1 << 30, dtype=sel.dtype)], dim=1)
    return sel.to(torch.int32).to(DEV)


def _brute_mask(Sq, Sk, q_offset, vertical, slash) -> torch.Tensor:
    """[H, Sq, Sk] by definition, loop by loop."""
    H = vertical.shape[0]
    mask = torch.zeros((H, Sq, Sk), dtype=torch.bool)
    for h in range(H):
        for i in range(Sq):
            p = q_offset + i
            for c in vertical[h].tolist():
                if 0 <= c < Sk and c <= p:
                    mask[h, i, c] = True
            for s in slash[h].tolist():
                if s >= 0 and 0 <= p - s < Sk:
                    mask[h, i, p - s] = True
    return mask


def _masked_attention(q, k, v, mask, scale):
    H, KVH = q.shape[1], k.shape[1]
    kf = k.float().transpose(0, 1).repeat_interleave(H // KVH, 0)
    vf = v.float().transpose(0, 1).repeat_interleave(H // KVH, 0)
    s = (q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale).masked_fill(~mask.to(q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return (p @ vf).transpose(0, 1), lse


def _check(out, ref, tol=None):
    tol = tol or (3e-3 if DEV.type == "cuda" else 1e-4)  # fp32 tl.dot is tf32 on the GPU
    o, lse = out
    ro, rlse = ref
    assert o.shape == ro.shape and lse.shape == rlse.shape and lse.dtype == torch.float32
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    finite = torch.isfinite(rlse)
    if finite.any():
        assert (lse[finite] - rlse[finite]).abs().max().item() < tol * 10
    assert (o.float() - ro.float()).abs().max().item() < tol * 10 and _rel_err(o, ro) < tol


# ------------------------------------------------------------------------------------------------ kernel
@pytest.mark.parametrize("sq,sk,h,kvh,d,q_offset,nv,ns", [
    (40, 40, 4, 4, 16, 0, 6, 5),      # self-attention, MHA
    (24, 70, 4, 2, 32, 46, 9, 7),     # queries at the end of the keys, GQA 2
    (33, 50, 8, 2, 16, 17, 12, 20),   # queries in the middle: keys after them are invisible, GQA 4
    (19, 20, 4, 1, 64, 45, 5, 8),     # queries past the keys (every key visible to every row)
    (45, 45, 2, 1, 16, 0, 30, 30),    # dense selections: columns overlap diagonals a lot
    (20, 48, 2, 2, 24, 28, 0, 6),     # no columns; head dim not a power of 2
    (20, 48, 2, 2, 16, 28, 7, 0),     # no diagonals (rows left of every column see nothing)
    (20, 30, 2, 1, 16, 0, 0, 0),      # nothing selected: o = 0, lse = -inf
])
def test_kernel_matches_reference(sq, sk, h, kvh, d, q_offset, nv, ns):
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    q = torch.randn(sq, h, d, generator=gen).to(DEV)
    k = torch.randn(sk, kvh, d, generator=gen).to(DEV)
    v = torch.randn(sk, kvh, d, generator=gen).to(DEV)
    vertical = _random_selection(h, sk, nv, gen, pad=3)
    slash = _random_selection(h, q_offset + sq, ns, gen, pad=2)
    scale = 0.7 / math.sqrt(d)
    ref = vertical_slash_attention_reference(q, k, v, vertical, slash, scale, q_offset)
    pairs = torch.zeros(h, dtype=torch.int64, device=DEV)  # the attention's count, per head
    _check(vertical_slash_attention(q, k, v, vertical, slash, scale, q_offset, pairs), ref)
    # the reference itself against the definition, and both pair counts against the mask
    mask = _brute_mask(sq, sk, q_offset, vertical.cpu(), slash.cpu())
    _check(ref, _masked_attention(q, k, v, mask, scale))
    assert vertical_slash_pair_count(sq, sk, q_offset, vertical, slash).tolist() == mask.sum((1, 2)).tolist()
    assert pairs.tolist() == mask.sum((1, 2)).tolist()


@pytest.mark.parametrize("bands", [False, True])
def test_kernel_rows_whose_max_grows_along_the_keys(bands):
    """The online softmax's rescaling in every loop (run tiles, scattered tiles, columns): q scaled up and key norms
    rising along the keys keep moving rows' maxima from tile to tile."""
    gen = torch.Generator().manual_seed(5)
    sq, sk, h, kvh, d, q_offset = 90, 300, 4, 2, 16, 210
    q, k, v = (torch.randn(n, hh, d, generator=gen).to(DEV) for n, hh in ((sq, h), (sk, kvh), (sk, kvh)))
    q, k = growing_row_maxima(q, k, 8.0)
    vertical = _random_selection(h, sk, 12, gen)
    if bands:
        slash = band_offsets(torch.tensor([[0, 2, 3]] * h), SLASH_BAND).to(DEV)
    else:
        slash = _random_selection(h, q_offset + sq, 40, gen)
    ref = vertical_slash_attention_reference(q, k, v, vertical, slash, 0.25, q_offset)
    _check(vertical_slash_attention(q, k, v, vertical, slash, 0.25, q_offset), ref)


@pytest.mark.skipif(DEV.type == "cuda", reason="tile shapes of the CPU interpreter")
@pytest.mark.parametrize("tiles", [(32, 32, 4, 1), (64, 32, 4, 1), (64, 64, 4, 1), (128, 64, 4, 1), (128, 128, 4, 1)])
def test_kernel_tile_shapes_pack_the_offset_bits(tiles, monkeypatch):
    """Tiles spanning 63 to 255 offsets: one to four selection words per tile, q_offset not tile-aligned."""
    from sparsekv.policies.minference import vertical_slash as module
    monkeypatch.setattr(module, "INTERPRET_CONFIG", tiles)
    gen = torch.Generator().manual_seed(tiles[0] + tiles[1])
    sq, sk, h, kvh, d, q_offset = 150, 300, 2, 1, 16, 150 + 37
    q, k, v = (torch.randn(n, hh, d, generator=gen).to(DEV) for n, hh in ((sq, h), (sk, kvh), (sk, kvh)))
    vertical = _random_selection(h, sk, 9, gen, pad=2)
    # two fully selected runs of offsets (full tiles) and scattered offsets (partial tiles)
    runs = torch.cat([torch.arange(70), torch.arange(200, 300)])
    slash = torch.stack([torch.cat([runs, torch.randperm(q_offset + sq - 300, generator=gen)[:20] + 300]).sort().values
                         for _ in range(h)]).to(DEV, torch.int32)
    ref = vertical_slash_attention_reference(q, k, v, vertical, slash, 0.25, q_offset)
    _check(vertical_slash_attention(q, k, v, vertical, slash, 0.25, q_offset), ref)


@pytest.mark.parametrize("bands", [[0, 2, 3, 5], [1, 3], [0, 1, 2, 3, 4, 5]])
def test_kernel_on_whole_bands(bands):
    """Band selections (runs of 64 offsets; a one-band gap leaves two runs in some tiles' windows)."""
    gen = torch.Generator().manual_seed(len(bands))
    sq, sk, h, kvh, d, q_offset = 100, 400, 2, 1, 16, 300
    q, k, v = (torch.randn(n, hh, d, generator=gen).to(DEV) for n, hh in ((sq, h), (sk, kvh), (sk, kvh)))
    vertical = _random_selection(h, sk, 5, gen)
    slash = band_offsets(torch.tensor([bands, bands[::-1][::-1]]), SLASH_BAND).to(DEV)
    ref = vertical_slash_attention_reference(q, k, v, vertical, slash, 0.25, q_offset)
    _check(vertical_slash_attention(q, k, v, vertical, slash, 0.25, q_offset), ref)


def test_kernel_every_column_or_every_diagonal_is_dense_attention():
    # a key on a selected column and a selected diagonal must count once: the union is then all keys
    gen = torch.Generator().manual_seed(7)
    sq, sk, h, kvh, d = 30, 50, 4, 2, 16
    q, k, v = (torch.randn(n, hh, d, generator=gen).to(DEV) for n, hh in ((sq, h), (sk, kvh), (sk, kvh)))
    dense = flash_attn_with_lse_reference(q, k, v, 0.25, causal=True)
    all_cols = torch.arange(sk, dtype=torch.int32, device=DEV).expand(h, -1).contiguous()
    all_offs = torch.arange(sk, dtype=torch.int32, device=DEV).expand(h, -1).contiguous()
    some = _random_selection(h, sk, 11, gen)
    for vertical, slash in ((all_cols, some), (some, all_offs), (all_cols, all_offs)):
        _check(vertical_slash_attention(q, k, v, vertical, slash, 0.25, sk - sq), dense)


def test_kernel_ignores_duplicates_and_out_of_range_entries():
    gen = torch.Generator().manual_seed(3)
    sq, sk, h, d = 20, 40, 2, 16
    q, k, v = (torch.randn(n, h, d, generator=gen).to(DEV) for n in (sq, sk, sk))
    clean_v = torch.tensor([[0, 5, 9], [3, 4, 30]], dtype=torch.int32, device=DEV)
    clean_s = torch.tensor([[0, 2], [1, 7]], dtype=torch.int32, device=DEV)
    messy_v = torch.tensor([[0, 5, 5, 9, 40, 99], [3, 3, 4, 30, 30, 1 << 30]], dtype=torch.int32, device=DEV)
    messy_s = torch.tensor([[0, 0, 2, 2, 40], [1, 7, 7, 77, 1 << 30]], dtype=torch.int32, device=DEV)
    expected = vertical_slash_attention_reference(q, k, v, clean_v, clean_s, 0.3, 20)
    _check(vertical_slash_attention(q, k, v, messy_v, messy_s, 0.3, 20), expected)
    _check(vertical_slash_attention_reference(q, k, v, messy_v, messy_s, 0.3, 20), expected)


def test_kernel_bad_inputs_raise():
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    sel = torch.zeros((4, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="vertical_idx"):
        vertical_slash_attention(q, k, k, torch.zeros((3, 2), dtype=torch.int32), sel)
    with pytest.raises(ValueError, match="slash_offsets"):
        vertical_slash_attention(q, k, k, sel, sel.float())
    with pytest.raises(ValueError, match="multiple of kv heads"):
        vertical_slash_attention(q, torch.randn(8, 3, 16), torch.randn(8, 3, 16), sel, sel)
    with pytest.raises(ValueError, match="q_offset"):
        vertical_slash_attention(q, k, k, sel, sel, q_offset=-1)
    with pytest.raises(ValueError, match="dtype"):
        vertical_slash_attention(q, k.double(), k.double(), sel, sel)


# ------------------------------------------------------------------------------------------- pattern estimate
def test_masses_reference_by_definition():
    gen = torch.Generator().manual_seed(3)
    L, H, KVH, D, Sk, row0 = 5, 4, 2, 8, 23, 15  # keys past the last row (20..22) are never seen
    q, k = torch.randn(L, H, D, generator=gen), torch.randn(Sk, KVH, D, generator=gen)
    col, diag = vertical_slash_masses_reference(q, k, 0.5, row0)
    expected_col, expected_diag = torch.zeros(H, Sk), torch.zeros(H, row0 + L)
    for h in range(H):
        for i in range(L):
            p = row0 + i
            w = torch.softmax(k[:p + 1, h // 2] @ q[i, h] * 0.5, dim=0)
            expected_col[h, :p + 1] += w
            for j in range(p + 1):
                expected_diag[h, p - j] += w[j]
    assert torch.allclose(col, expected_col, atol=1e-5) and torch.allclose(diag, expected_diag, atol=1e-5)
    assert col[:, 20:].abs().max() == 0


@pytest.mark.parametrize("L,H,KVH,D,Sk,row0", [
    (8, 4, 2, 16, 50, 42),  # the last 8 of 50 keys
    (5, 2, 1, 32, 37, 20),  # rows before the end of the keys, L not a power of two
    (16, 4, 4, 16, 100, 84),
    (3, 2, 2, 24, 10, 30),  # rows after every key (offloaded chunks' prefix blocks), D not a power of two
])
def test_masses_kernel_matches_reference(L, H, KVH, D, Sk, row0):
    gen = torch.Generator().manual_seed(L * Sk + row0)
    q, k = torch.randn(L, H, D, generator=gen).to(DEV), torch.randn(Sk, KVH, D, generator=gen).to(DEV)
    col, diag = vertical_slash_masses(q, k, 0.3, row0)
    ref_col, ref_diag = vertical_slash_masses_reference(q, k, 0.3, row0)
    assert col.shape == (H, Sk) and diag.shape == (H, row0 + L)
    assert torch.allclose(col, ref_col, **TOL) and torch.allclose(diag, ref_diag, **TOL)
    # each row sums to 1
    assert torch.allclose(diag.sum(1), torch.full((H,), float(L), device=DEV),
                          atol=1e-4 if DEV.type == "cpu" else 1e-2)


@pytest.mark.parametrize("L,Sk,row0,offsets_from", [
    (7, 300, 293, 0),  # several key splits
    (7, 300, 293, 150),  # only the offsets from 150 on
    (5, 90, 120, 31),  # rows after every key (a streamed prefix group): offsets 31 .. 124
])
def test_masses_with_a_given_normaliser_and_offset_window(L, Sk, row0, offsets_from):
    gen = torch.Generator().manual_seed(Sk + offsets_from)
    q, k = torch.randn(L, 4, 16, generator=gen).to(DEV), torch.randn(Sk, 2, 16, generator=gen).to(DEV)
    lse = (torch.randn(4, L, generator=gen) * 3).to(DEV)
    lse[0, 0] = -80.0  # far below the scores: probabilities capped at 2^100, still finite
    col, diag = vertical_slash_masses(q, k, 0.4, row0, lse=lse, offsets_from=offsets_from)
    ref_col, ref_diag = vertical_slash_masses_reference(q, k, 0.4, row0, lse=lse, offsets_from=offsets_from)
    assert diag.shape == (4, row0 + L - offsets_from) and torch.isfinite(col).all() and torch.isfinite(diag).all()
    assert torch.allclose(col, ref_col, **TOL) and torch.allclose(diag, ref_diag, **TOL)
    # with the rows' own log-sum-exp it is the plain estimate
    own = last_rows_lse(q, k, 0.4, row0)
    assert torch.allclose(own, last_rows_lse_reference(q, k, 0.4, row0), **TOL)
    col, diag = vertical_slash_masses(q, k, 0.4, row0, lse=own, offsets_from=offsets_from)
    plain_col, plain_diag = vertical_slash_masses_reference(q, k, 0.4, row0)
    assert torch.allclose(col, plain_col, **TOL) and torch.allclose(diag, plain_diag[:, offsets_from:], **TOL)


def test_masses_exclude_columns_from_the_diagonals():
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(6, 4, 16, generator=gen).to(DEV), torch.randn(40, 2, 16, generator=gen).to(DEV)
    cols = torch.tensor([[0, 5, 33], [7, 8, 1 << 30], [39, 40, 41], [2, 3, 4]], dtype=torch.int32, device=DEV)
    col, diag = vertical_slash_masses(q, k, 0.4, 34, exclude_columns=cols)
    ref_col, ref_diag = vertical_slash_masses_reference(q, k, 0.4, 34, exclude_columns=cols)
    all_col, all_diag = vertical_slash_masses_reference(q, k, 0.4, 34)
    assert torch.allclose(col, ref_col, **TOL) and torch.allclose(diag, ref_diag, **TOL)
    assert torch.allclose(col, all_col, **TOL)  # the column masses are unchanged
    for h in range(4):  # the diagonals lose exactly the excluded (in-range) columns' mass
        kept = [c for c in cols[h].tolist() if c < 40]
        assert diag[h].sum().item() == pytest.approx(all_diag[h].sum().item() - all_col[h, kept].sum().item(),
                                                     abs=1e-4 if DEV.type == "cpu" else 1e-3)


def test_masses_reject_bad_input():
    q, k = torch.randn(4, 2, 8), torch.randn(10, 1, 8)
    with pytest.raises(ValueError, match="row0"):
        vertical_slash_masses(q, k, 1.0, -1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        vertical_slash_masses(torch.randn(4, 3, 8), torch.randn(10, 2, 8), 1.0, 6)
    with pytest.raises(ValueError, match="lse must be"):
        vertical_slash_masses(q, k, 1.0, 6, lse=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="offsets_from"):
        vertical_slash_masses(q, k, 1.0, 6, offsets_from=11)


def test_top_indices_equals_topk():
    gen = torch.Generator().manual_seed(9)
    for W, k in ((4096, 50), (4100, 50), (300, 50), (5000, 1)):
        x = torch.randn(3, W, generator=gen).to(DEV)
        x[0, :40] = float("inf")  # forced entries
        x[1, ::7] = 0.5  # ties
        idx = top_indices(x, k, segment=16)
        assert idx.shape == (3, k) and all(len(set(row)) == k for row in idx.tolist())
        assert torch.equal(x.gather(1, idx).sort(1).values, torch.topk(x, k, dim=1).values.sort(1).values)


def test_band_and_compaction_helpers():
    diag = torch.arange(10, dtype=torch.float32).expand(2, -1)
    assert band_sums(diag, 4).tolist() == [[6.0, 22.0, 17.0]] * 2
    assert band_offsets(torch.tensor([[0, 2]]), 3).tolist() == [[0, 1, 2, 6, 7, 8]]
    sel = torch.tensor([[True, False, True, True], [False] * 4])
    assert compact(sel, 5).tolist() == [[5, 7, 8, 1 << 30], [1 << 30] * 4]


# ------------------------------------------------------------------------------------------------ policy
def test_hyperparameter_validation_names_the_field():
    for field, value in [("last_q", 0), ("vertical_size", -1), ("slash_size", -5), ("sink_tokens", -1),
                         ("recent_diagonals", 1.5), ("adaptive_budget", 0.0), ("adaptive_budget", 1.5),
                         ("last_q", True), ("slash_excludes_vertical", 1), ("whole_prompt_prefill", "yes"),
                         ("slash_granularity", 32),
                         ("slash_granularity", 64.0), ("slash_granularity", True),
                         ("early_chunk_budget_scale", 0.5), ("early_chunk_budget_scale", True),
                         ("early_chunk_budget_scale", float("inf")), ("early_chunk_budget_scale", "2")]:
        with pytest.raises(ValueError, match=field):
            MInferencePolicy(**{field: value})
    assert MInferencePolicy(adaptive_budget=0.1).budgets(1000) == (100, 100)
    assert MInferencePolicy(vertical_size=5, slash_size=7, sink_tokens=30).budgets(20) == (20, 20)


def test_chunks_before_the_prompts_last_keep_scaled_budgets():
    assert MInferencePolicy().budgets(10 ** 5) == (250, 1500)
    assert MInferencePolicy().budgets(10 ** 5, ends_prompt=False) == (500, 3000)
    assert MInferencePolicy(early_chunk_budget_scale=1.5).budgets(10 ** 5, ends_prompt=False) == (375, 2250)
    assert MInferencePolicy(early_chunk_budget_scale=1).budgets(10 ** 5, ends_prompt=False) == (250, 1500)
    assert MInferencePolicy(adaptive_budget=0.1).budgets(1000, ends_prompt=False) == (200, 200)
    assert MInferencePolicy().budgets(2000, ends_prompt=False) == (500, 2000)  # at most the keys


@pytest.mark.parametrize("offload", ["cpu", "none"])
def test_only_the_prompts_last_chunk_keeps_the_base_budgets(qwen3_ckpt, offload, monkeypatch):
    """Offloaded prefill in chunks, and resident prefill with whole_prompt_prefill=false: the pattern of a chunk
    whose last rows are inside the context is chosen with the scaled budgets; the chunk that ends the prompt (and
    every whole-prompt step) with the base ones."""
    monkeypatch.delenv(_dispatch.ENV_BACKEND, raising=False)
    chunks = ["scheduler.max_num_batched_tokens=64"] + (
        ["offload.block_size=16", "offload.prefill_chunk_size=64"] if offload == "cpu" else
        ["policy.whole_prompt_prefill=false"])
    llm = LLM(str(qwen3_ckpt), overrides=CPU + [f"offload={offload}", "policy=minference", "policy.vertical_size=4",
                                               "policy.slash_size=8", "policy.sink_tokens=1",
                                               "policy.recent_diagonals=1", "policy.last_q=8",
                                               "policy.slash_granularity=1", *chunks])
    policy = llm.engine.kv_store.prefill_policy
    seen: list[tuple[int, bool]] = []
    original = policy.budgets
    monkeypatch.setattr(policy, "budgets", lambda keys, ends_prompt=True: seen.append((keys, ends_prompt))
                        or original(keys, ends_prompt))
    llm.generate([random_prompt(150, seed=3)], GREEDY)
    per_chunk = sorted(set(seen))
    if offload == "cpu":
        assert per_chunk == [(64, False), (128, False), (150, True)]
        assert original(64, False) == (8, 16) and original(150, True) == (4, 8)
    else:  # the resident store does not say which chunk ends the prompt: every chunk keeps the scaled budgets
        assert per_chunk == [(64, False), (128, False), (150, False)]


def test_hyperparameter_validation_through_the_config(qwen3_ckpt):
    with pytest.raises(ValueError, match="slash_size"):
        LLM(str(qwen3_ckpt), overrides=CPU + ["policy=minference", "policy.slash_size=-3"])


def _prefill_query_lengths(llm: LLM, monkeypatch) -> list[int]:
    """The query lengths compute_prefill sees in layer 0, recorded while llm runs."""
    seen: list[int] = []
    policy = llm.engine.kv_store.prefill_policy
    original = policy.compute_prefill

    def record(q, k, v, layer_id, softmax_scale):
        if layer_id == 0:
            seen.append(q.shape[0])
        return original(q, k, v, layer_id, softmax_scale)

    monkeypatch.setattr(policy, "compute_prefill", record)
    return seen


@pytest.mark.parametrize("whole", [True, False])
def test_resident_prefill_takes_the_whole_prompt_in_one_step(qwen3_ckpt, whole, monkeypatch):
    """offload=none: by default the pattern is estimated from the prompt's last queries, so the prompt is one step
    however small scheduler.max_num_batched_tokens is; whole_prompt_prefill=false keeps the scheduler's chunks."""
    monkeypatch.delenv(_dispatch.ENV_BACKEND, raising=False)  # references: the kernels are tested above
    llm = LLM(str(qwen3_ckpt), overrides=CPU + ["policy=minference", "scheduler.max_num_batched_tokens=64",
                                               f"policy.whole_prompt_prefill={str(whole).lower()}"])
    assert llm.engine.scheduler.max_num_batched_tokens == (llm.engine.max_model_len if whole else 64)
    seen = _prefill_query_lengths(llm, monkeypatch)
    out = llm.generate([random_prompt(150, seed=3)], GREEDY)[0]
    assert len(out.token_ids) == 4
    assert seen == ([150] if whole else [64, 64, 22])


def test_whole_prompt_prefill_budget_room_and_a_bad_plugin_value():
    cfg = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=8192))
    assert prefill_step_tokens(cfg, MInferencePolicy(), 32768) == 32768
    assert prefill_step_tokens(cfg, MInferencePolicy(), 4096) == 8192
    assert prefill_step_tokens(cfg, MInferencePolicy(whole_prompt_prefill=False), 32768) == 8192
    assert prefill_step_tokens(cfg, FullAttentionPolicy(), 32768) == 8192
    check_whole_prompt_room(128, 256, 32768, 32768, 8192, "minference")  # one sequence fits
    check_whole_prompt_room(8, 256, 32768, 8192, 8192, "minference")  # chunked: the pool is the scheduler's matter
    with pytest.raises(ValueError, match="whole_prompt_prefill=false"):
        check_whole_prompt_room(100, 256, 32768, 32768, 8192, "minference")
    plugin = MInferencePolicy()
    plugin.name, plugin.whole_prompt_prefill = "my_plugin", 1
    with pytest.raises(ValueError, match="my_plugin.*whole_prompt_prefill=1"):
        prefill_step_tokens(cfg, plugin, 32768)


def _qkv(n_q, s, h, kvh, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_q, h, d, generator=gen), torch.randn(s, kvh, d, generator=gen),
            torch.randn(s, kvh, d, generator=gen))


@pytest.mark.parametrize("shortcut,granularity", [(False, 1), (True, 1), (False, SLASH_BAND)])
def test_compute_prefill_full_budget_is_dense(shortcut, granularity, monkeypatch):
    monkeypatch.setattr(MInferencePolicy, "dense_when_all_kept", shortcut)
    q, k, v = _qkv(48, 80, 4, 2, 16, seed=1)
    policy = MInferencePolicy(vertical_size=10 ** 6, slash_size=10 ** 6, last_q=16, slash_granularity=granularity)
    out = policy.compute_prefill(q.to(DEV), k.to(DEV), v.to(DEV), 0, 0.25)
    dense, _ = flash_attn_with_lse_reference(q, k, v, 0.25, causal=True)
    assert _rel_err(out.cpu(), dense) < EXACT
    assert policy.last_density == pytest.approx(1.0)


def _chunked_prefill(policy, q, k, v, c0: int, bs: int, scale: float, slots: int = 4):
    """Run compute_chunked_prefill for the chunk at positions c0.. with the prefix in a real host pool; the chunk
    ends its prompt, as the offloaded store says through prompt_len."""
    S, kvh, d = k.shape
    nblk = c0 // bs
    host = HostPool(1, nblk + 1, bs, kvh, d, k.dtype, pin_memory=False)
    host.ensure_capacity(nblk + 1)
    engine = OffloadEngine(host, slots, S, 1, DEV)
    engine.write_prefill_buffer(0, k[:c0].to(DEV), v[:c0].to(DEV))
    table = list(range(nblk))[::-1]  # host block ids out of position order
    for i, blk in enumerate(table):
        engine.offload_prefill_buffer_async(0, blk, bs, i * bs)
    engine.transfer_stats["h2d_blocks"] = 0
    n = q.shape[0]
    ctx = PolicyContext(phase="prefill", layer=0, query=q.to(DEV), candidates=table, block_size=bs, query_start=c0,
                        kv_len=c0 + n, softmax_scale=scale, chunk_keys=k[c0:].to(DEV), prompt_len=c0 + n)
    out = policy.compute_chunked_prefill(q.to(DEV), k[c0:].to(DEV), v[c0:].to(DEV), ctx, RingReader(engine, 0))
    assert engine.transfer_stats["h2d_blocks"] == nblk  # one pass: every prefix block loaded once
    return out.cpu()


@pytest.mark.parametrize("c0,n,slots,granularity", [
    (0, 40, 4, 1), (64, 32, 4, 1), (48, 45, 4, 1),
    (80, 45, 2, 1),  # groups of one block
    (80, 45, 6, SLASH_BAND),  # groups of 3 blocks, the last one partial; bands straddle the groups
])
def test_chunked_prefill_full_budget_is_dense(c0, n, slots, granularity, sparse_path):
    q, k, v = _qkv(n, c0 + n, 4, 2, 16, seed=c0 + n)
    policy = MInferencePolicy(vertical_size=10 ** 6, slash_size=10 ** 6, last_q=8, slash_granularity=granularity)
    out = _chunked_prefill(policy, q, k, v, c0, 16, 0.25, slots)
    dense, _ = flash_attn_with_lse_reference(q, k, v, 0.25, causal=True)
    assert _rel_err(out, dense) < EXACT
    assert policy.last_density == pytest.approx(1.0)


def diagonal_policy(**fields) -> MInferencePolicy:
    """MInference's own selection, single diagonals: the planted patterns below pick a diagonal or two, which a
    64-offset band (the default) would round up to the whole toy sequence."""
    return MInferencePolicy(slash_granularity=1, **fields)


def _planted(S: int, n: int, column: int, offset: int, d: int = 64, h: int = 2, seed: int = 0):
    """Keys are random unit vectors u_j, except key `column` = w; query p = 14 (u_{p-offset} + w): the column
    and the diagonal carry nearly all of every row's mass (rows p < offset only the column)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(S, d, generator=gen), dim=-1)
    w = torch.nn.functional.normalize(torch.randn(d, generator=gen), dim=-1)
    k = u.clone()
    k[column] = w
    pos = torch.arange(S - n, S)
    target = u[(pos - offset).clamp(min=0)] * (pos >= offset)[:, None]
    q = 14.0 * (target + w)
    q = q[:, None, :].expand(n, h, d).contiguous()
    v = torch.randn(S, 1, d, generator=gen)
    return q, k[:, None, :].contiguous(), v


def test_planted_pattern_is_found_and_density_is_low():
    S, n, column, offset = 256, 160, 77, 41  # every query sees the column and its diagonal
    q, k, v = _planted(S, n, column, offset)
    policy = diagonal_policy(last_q=32, vertical_size=4, slash_size=6, sink_tokens=2, recent_diagonals=3)
    vertical, slash = policy.estimate_pattern(q.to(DEV), k.to(DEV), 1.0)
    assert (vertical == column).any(dim=1).all() and (slash == offset).any(dim=1).all()
    out = policy.compute_prefill(q.to(DEV), k.to(DEV), v.to(DEV), 0, 1.0).cpu()
    dense, _ = flash_attn_with_lse_reference(q, k, v, 1.0, causal=True)
    assert policy.last_density < 0.1
    assert _rel_err(out, dense) < 0.02
    # without the planted column the result is far off: the test above is not trivially satisfied
    policy = MInferencePolicy(last_q=32, vertical_size=2, slash_size=6, sink_tokens=2, recent_diagonals=3)
    assert _rel_err(policy.compute_prefill(q.to(DEV), k.to(DEV), v.to(DEV), 0, 1.0).cpu(), dense) > 0.1


def test_band_selection_finds_the_planted_band():
    S, n, column, offset = 512, 320, 77, 200  # the planted diagonal lies in band 3 (offsets 192 .. 255)
    q, k, v = _planted(S, n, column, offset)
    # the last-q rows meet the column on offsets 403 .. 434, all in band 6, which it lifts as much as the diagonal
    # lifts band 3: the column's mass must stay out of the band sums
    policy = MInferencePolicy(last_q=32, vertical_size=4, slash_size=2 * SLASH_BAND, sink_tokens=2,
                              recent_diagonals=3, slash_granularity=SLASH_BAND, slash_excludes_vertical=True)
    vertical, slash = policy.estimate_pattern(q.to(DEV), k.to(DEV), 1.0)
    assert (vertical == column).any(dim=1).all()
    # whole bands: the forced recent band 0 and the planted one
    expected = torch.cat([torch.arange(SLASH_BAND), torch.arange(3 * SLASH_BAND, 4 * SLASH_BAND)])
    assert slash.tolist() == [expected.tolist()] * 2
    out = policy.compute_prefill(q.to(DEV), k.to(DEV), v.to(DEV), 0, 1.0).cpu()
    dense, _ = flash_attn_with_lse_reference(q, k, v, 1.0, causal=True)
    assert policy.last_density < 0.4 and _rel_err(out, dense) < 0.02  # 2 of 8 bands, 4 columns
    # a slash budget below one band still keeps one whole band (rounded up), here the forced recent one
    policy = MInferencePolicy(last_q=32, vertical_size=4, slash_size=6, sink_tokens=2, recent_diagonals=3,
                              slash_granularity=SLASH_BAND)
    assert policy.estimate_pattern(q.to(DEV), k.to(DEV), 1.0)[1].tolist() == [list(range(SLASH_BAND))] * 2
    assert _rel_err(policy.compute_prefill(q.to(DEV), k.to(DEV), v.to(DEV), 0, 1.0).cpu(), dense) > 0.1


def test_band_selection_keeps_the_heaviest_band_not_the_heaviest_diagonal():
    # band 2 holds one strong diagonal, band 4 three weaker ones of more mass together: bands rank by their sum
    S, L, d = 400, 16, 64
    gen = torch.Generator().manual_seed(5)
    u = torch.nn.functional.normalize(torch.randn(S, d, generator=gen), dim=-1)
    pos = torch.arange(S - L, S)
    q = 8.0 * u[pos - 150] + 7.0 * (u[pos - 270] + u[pos - 280] + u[pos - 290])
    q, k = q[:, None, :].contiguous().to(DEV), u[:, None, :].contiguous().to(DEV)
    bands = {}
    for granularity in (1, SLASH_BAND):
        policy = MInferencePolicy(last_q=L, vertical_size=0, slash_size=SLASH_BAND + 1, sink_tokens=0,
                                  recent_diagonals=SLASH_BAND, slash_granularity=granularity)
        slash = policy.estimate_pattern(q, k, 1.0)[1][0]
        bands[granularity] = sorted({o // SLASH_BAND for o in slash.tolist()})
    assert bands == {1: [0, 2], SLASH_BAND: [0, 4]}


def test_slash_budget_is_not_spent_on_a_selected_column():
    # a column every last-q row reads strongly lifts one diagonal per row; a weaker true diagonal must still win
    S, L, d, column, offset = 200, 16, 32, 50, 30
    gen = torch.Generator().manual_seed(2)
    u = torch.nn.functional.normalize(torch.randn(S, d, generator=gen), dim=-1)
    w = torch.nn.functional.normalize(torch.randn(d, generator=gen), dim=-1)
    k = u.clone()
    k[column] = w
    pos = torch.arange(S - L, S)
    q = 9.0 * w + 4.5 * u[pos - offset]  # the column dominates each row; the diagonal keys are second
    q, k = q[:, None, :].contiguous().to(DEV), k[:, None, :].contiguous().to(DEV)
    found = {}
    for exclude in (True, False):
        policy = diagonal_policy(last_q=L, vertical_size=1, slash_size=3, sink_tokens=0, recent_diagonals=2,
                                 slash_excludes_vertical=exclude)
        vertical, slash = policy.estimate_pattern(q, k, 1.0)
        assert vertical.tolist() == [[column]]
        found[exclude] = offset in slash[0].tolist()
    assert found == {True: True, False: False}


@pytest.mark.parametrize("slots", [2, 4])  # groups of one and of two blocks
def test_planted_pattern_through_the_offloaded_chunks(slots):
    S, n, column, offset = 192, 64, 20, 100  # column in the oldest block; the diagonal crosses 3 blocks
    q, k, v = _planted(S, n, column, offset, seed=1)
    policy = diagonal_policy(last_q=32, vertical_size=8, slash_size=8, sink_tokens=2, recent_diagonals=3)
    out = _chunked_prefill(policy, q, k, v, S - n, 32, 1.0, slots)
    dense, _ = flash_attn_with_lse_reference(q, k, v, 1.0, causal=True)
    assert policy.last_density < 0.25
    assert _rel_err(out, dense) < 0.02


def test_planted_band_through_the_offloaded_chunks():
    S, n, column, offset = 512, 128, 20, 300  # offset 300 in band 4; the column in the oldest group
    q, k, v = _planted(S, n, column, offset, seed=2)
    policy = MInferencePolicy(last_q=32, vertical_size=8, slash_size=2 * SLASH_BAND, sink_tokens=2,
                              recent_diagonals=3, slash_granularity=SLASH_BAND)
    out = _chunked_prefill(policy, q, k, v, S - n, 32, 1.0, slots=4)
    dense, _ = flash_attn_with_lse_reference(q, k, v, 1.0, causal=True)
    # the newest group sees only bands 0 and 1 before its selection (online selection: module docstring)
    assert policy.last_density < 0.5
    assert _rel_err(out, dense) < 0.02


def test_small_budget_density_below_one():
    q, k, v = _qkv(160, 160, 2, 1, 16, seed=5)
    policy = diagonal_policy(vertical_size=10, slash_size=10, sink_tokens=4, recent_diagonals=4)
    policy.compute_prefill(q.to(DEV), k.to(DEV), v.to(DEV), 0, 0.25)
    assert 0.0 < policy.last_density < 0.2
    adaptive = diagonal_policy(adaptive_budget=0.5)
    adaptive.compute_prefill(q.to(DEV), k.to(DEV), v.to(DEV), 0, 0.25)
    assert policy.last_density < adaptive.last_density < 1.0


# ------------------------------------------------------------------------------------------------ engine
@pytest.mark.parametrize("granularity", [SLASH_BAND, 1])
@pytest.mark.parametrize("offload", [["offload=cpu", "offload.block_size=16", "offload.prefill_chunk_size=32"],
                                     ["offload=none", "offload.block_size=16"]])
def test_engine_full_budget_greedy_equals_full(qwen3_ckpt, offload, granularity, sparse_path, monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_BACKEND, raising=False)  # references: the kernel is tested above
    prompt = random_prompt(70, seed=11)
    expected = LLM(str(qwen3_ckpt), overrides=CPU + offload + ["policy=full"]).generate([prompt], GREEDY)
    llm = LLM(str(qwen3_ckpt), overrides=CPU + offload + FULL_BUDGET + [f"policy.slash_granularity={granularity}"])
    assert llm.engine.policy.name == "minference"
    out = llm.generate([prompt], GREEDY)
    assert out[0].token_ids == expected[0].token_ids
    assert llm.engine.policy.last_density == pytest.approx(1.0)


def test_engine_small_budget_runs_sparse(qwen3_ckpt, monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_BACKEND, raising=False)
    llm = LLM(str(qwen3_ckpt), overrides=CPU + ["offload=cpu", "offload.block_size=16",
                                                "offload.prefill_chunk_size=32", "policy=minference",
                                                "policy.vertical_size=8", "policy.slash_size=8",
                                                "policy.sink_tokens=4", "policy.recent_diagonals=4",
                                                "policy.slash_granularity=1"])
    out = llm.generate([random_prompt(70, seed=12)], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    assert llm.engine.policy.last_density < 0.8


class _Hopper:  # the device properties max_estimate_rows reads, as an H100 / H200 reports them
    shared_memory_per_block_optin = 232448


def test_estimate_rows_limited_by_shared_memory_with_a_clear_error(monkeypatch):
    """last_q rows and as many keys share one double-buffered shared-memory tile: on a Hopper GPU 512 rows at
    head_dim 128 in bf16 need 524,288 bytes (Triton's own count when it refused them), so the policy refuses them
    when the store is built, naming the field and the most that fits."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(estimate, "use_triton", lambda device: True)
    monkeypatch.setattr(estimate, "triton_interpret", lambda: False)
    monkeypatch.setattr(estimate, "HAS_TRITON", True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Hopper())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert estimate.max_estimate_rows(128, torch.bfloat16, cuda) == 128
    assert estimate.max_estimate_rows(128, torch.float32, cuda) == 64
    assert estimate.max_estimate_rows(256, torch.bfloat16, cuda) == 64
    assert estimate.max_estimate_rows(128, torch.bfloat16, torch.device("cpu")) is None
    layout = SimpleNamespace(head_dim=128, dtype=torch.bfloat16, device=cuda)
    MInferencePolicy(last_q=128).initialize(layout)
    with pytest.raises(ValueError, match=r"policy.last_q=512: .*H100.* at most 128 .*use policy.last_q <= 128"):
        MInferencePolicy(last_q=512).initialize(layout)
    with pytest.raises(ValueError, match="q_last's rows=256"):  # what the kernels' launchers check
        estimate.check_estimate_rows(256, 128, torch.bfloat16, cuda, "q_last's rows")


# ------------------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
def test_gpu_last_q_past_shared_memory_is_refused_before_any_work(qwen3_ckpt):
    head_dim = json.loads((qwen3_ckpt / "config.json").read_text())["head_dim"]
    most = estimate.max_estimate_rows(head_dim, torch.bfloat16, torch.device("cuda"))
    LLM(str(qwen3_ckpt), overrides=["device=cuda", "dtype=bfloat16", "policy=minference", f"policy.last_q={most}"])
    with pytest.raises(ValueError, match=f"policy.last_q={2 * most}: .* at most {most} .*use policy.last_q <= {most}"):
        LLM(str(qwen3_ckpt), overrides=["device=cuda", "dtype=bfloat16", "policy=minference",
                                        f"policy.last_q={2 * most}"])


@pytest.mark.gpu
def test_gpu_kernel_bf16_realistic():
    from tests.kernels.test_vertical_slash_index import pair_count_by_offsets

    sq = sk = 4096
    h, kvh, d = 32, 8, 128
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sq, h, d, generator=gen).to(DEV, torch.bfloat16)
    k = torch.randn(sk, kvh, d, generator=gen).to(DEV, torch.bfloat16)
    v = torch.randn(sk, kvh, d, generator=gen).to(DEV, torch.bfloat16)
    vertical = torch.cat([torch.arange(30).expand(h, -1), 30 + torch.stack(
        [torch.randperm(sk - 30, generator=gen)[:970] for _ in range(h)])], 1).sort(1).values
    slash = torch.cat([torch.arange(100).expand(h, -1), 100 + torch.stack(
        [torch.randperm(sk - 100, generator=gen)[:500] for _ in range(h)])], 1).sort(1).values
    vertical, slash = vertical.to(DEV, torch.int32), slash.to(DEV, torch.int32)
    scale = 1 / math.sqrt(d)
    pairs = torch.zeros(h, dtype=torch.int64, device=DEV)
    o, lse = vertical_slash_attention(q, k, v, vertical, slash, scale, 0, pairs)
    ro, rlse = vertical_slash_attention_reference(q, k, v, vertical, slash, scale, 0)
    assert not o.isnan().any() and not lse.isnan().any()
    assert _rel_err(o, ro) < 1e-2
    assert (lse - rlse).abs().max().item() < 1e-2
    assert torch.equal(pairs, pair_count_by_offsets(sq, sk, 0, vertical, slash))


@pytest.mark.gpu
@pytest.mark.parametrize("sk", [8192, 32768 + 77])
def test_gpu_masses_bf16_realistic(sk):
    h, kvh, d, L = 32, 8, 128, 64
    gen = torch.Generator().manual_seed(sk)
    q = torch.randn(L, h, d, generator=gen).to(DEV, torch.bfloat16)
    k = torch.randn(sk, kvh, d, generator=gen).to(DEV, torch.bfloat16)
    col, diag = vertical_slash_masses(q, k, 1 / math.sqrt(d))
    ref_col, ref_diag = vertical_slash_masses_reference(q, k, 1 / math.sqrt(d), sk - L)
    assert _rel_err(col, ref_col) < 1e-2 and _rel_err(diag, ref_diag) < 1e-2


@pytest.mark.gpu
def test_gpu_masses_with_given_lse_and_offset_window():
    h, kvh, d, L, sk = 32, 8, 128, 64, 20000
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(L, h, d, generator=gen).to(DEV, torch.bfloat16)
    k = torch.randn(sk, kvh, d, generator=gen).to(DEV, torch.bfloat16)
    row0, scale = sk + 3000, 1 / math.sqrt(d)  # rows after every key, as for a streamed prefix group
    lse = last_rows_lse(q, k, scale, row0) - 2.0
    col, diag = vertical_slash_masses(q, k, scale, row0, lse=lse, offsets_from=3001)
    ref_col, ref_diag = vertical_slash_masses_reference(q, k, scale, row0, lse=lse, offsets_from=3001)
    assert _rel_err(col, ref_col) < 1e-2 and _rel_err(diag, ref_diag) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", [1, SLASH_BAND])
def test_gpu_estimate_and_prefill_do_not_sync(granularity):
    from tests.conftest import host_sync_sites

    h, kvh, d, n, sk = 32, 8, 128, 2048, 16384
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(n, h, d, generator=gen).to(DEV, torch.bfloat16)
    k, v = (torch.randn(sk, kvh, d, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    policy = MInferencePolicy(slash_granularity=granularity)
    policy.compute_prefill(q, k, v, 0, d ** -0.5)  # compile first
    assert host_sync_sites(lambda: policy.estimate_pattern(q, k, d ** -0.5)) == []
    vertical, slash = policy.estimate_pattern(q, k, d ** -0.5)
    bands = -(-policy.slash_size // SLASH_BAND)
    assert vertical.shape == (h, policy.vertical_size)
    assert slash.shape[1] == (policy.slash_size if granularity == 1 else bands * SLASH_BAND)
    out = policy.compute_prefill(q, k, v, 0, d ** -0.5)
    ref, _ = vertical_slash_attention_reference(q, k, v, vertical, slash, d ** -0.5, sk - n)
    assert _rel_err(out, ref) < 1e-2
