"""block_sparse_attention's phase-1 loops (runs, lists, auto) and block_lists.block_runs, against the pure-torch
reference on fresh random inputs: ragged and structured selections, runs that end at the causal diagonal, rows
without their diagonal block or without any block, GQA, queries at an offset (chunked prefill) and in the middle.

On CPU the kernel runs under the Triton interpreter (fp32 / fp16, small sizes: see tests/kernels/test_xattn_kernels.py);
the GPU-marked tests at the end run bf16 at realistic sizes and check that the launch does not sync.
"""
from __future__ import annotations

import math

import pytest
import torch

from sparsekv.policies.xattn import block_sparse_attention as bsa_module
from sparsekv.kernels.attention import flash_attn_with_lse
from sparsekv.policies.xattn.block_lists import block_lists_from_mask, block_runs
from sparsekv.policies.xattn.block_sparse_attention import (
    LoopConfig,
    block_sparse_attention,
    block_sparse_attention_reference,
    loop_config,
)
from tests.conftest import growing_row_maxima, host_sync_sites

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 3e-3 if DEV.type == "cuda" else 1e-5  # fp32 tl.dot is tf32 on the GPU

pytestmark = pytest.mark.usefixtures("triton_kernels", "one_thread")


def _layout(n: int, seq: int, bs: int, q_start: int) -> tuple[int, int, int]:
    qb0 = q_start // bs
    return qb0, -(-(q_start + n) // bs) - qb0, -(-seq // bs)


def _selection(kind: str, qb0: int, nqb: int, nkb: int, gen: torch.Generator) -> torch.Tensor:
    """keep [nqb, nkb] bool, causal (no block after the query block)."""
    qb = torch.arange(qb0, qb0 + nqb)[:, None]
    kb = torch.arange(nkb)[None, :]
    visible = kb <= qb
    ragged = torch.rand(nqb, nkb, generator=gen) < 0.35
    if kind == "ragged":  # scattered blocks, the diagonal kept
        keep = ragged | (kb == qb)
    elif kind == "structured":  # sink, stripes two blocks wide, a local band ending at the diagonal
        keep = (kb == 0) | (kb % 5 < 2) | ((qb - kb) < 3)
    elif kind == "dense":
        keep = visible
    elif kind == "mixed":  # even rows one run, odd rows scattered: auto takes both loops in one launch
        keep = torch.where(qb % 2 == 0, visible, ragged | (kb == qb))
    elif kind == "holes":  # diagonal dropped in some rows, some rows empty
        keep = ragged & (torch.rand(nqb, 1, generator=gen) < 0.7)
    else:
        raise ValueError(kind)
    return (keep & visible).to(DEV)


def _runs_definition(keep: torch.Tensor, qb0: int) -> list[tuple[list[tuple[int, int]], int, bool]]:
    """Per row: the runs [lo, hi) of kept blocks before the query block, their block count, diagonal kept."""
    out = []
    for r, row in enumerate(keep.tolist()):
        qb, runs, j = qb0 + r, [], 0
        while j < min(qb, len(row)):
            if row[j]:
                lo = j
                while j < qb and row[j]:
                    j += 1
                runs.append((lo, j))
            else:
                j += 1
        out.append((runs, sum(hi - lo for lo, hi in runs), qb < len(row) and row[qb]))
    return out


@pytest.mark.parametrize("kind", ["ragged", "structured", "dense", "mixed", "holes"])
@pytest.mark.parametrize("qb0", [0, 3])
def test_block_runs_match_definition(kind, qb0):
    gen = torch.Generator().manual_seed(qb0 * 11 + len(kind))
    nkb = 23
    nqb = nkb - qb0
    keep = _selection(kind, qb0, nqb, nkb, gen)
    keep[:, -1] |= torch.rand(nqb, generator=gen).to(DEV) < 0.5  # listed blocks after the diagonal are dropped
    runs = block_runs(*block_lists_from_mask(keep), qb0)
    expected = _runs_definition(keep, qb0)
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in runs)
    assert runs.n_runs.tolist() == [len(e[0]) for e in expected]
    assert runs.n_full.tolist() == [e[1] for e in expected]
    assert runs.diag.tolist() == [int(e[2]) for e in expected]
    for r, (row_runs, _, _) in enumerate(expected):
        k = len(row_runs)
        assert list(zip(runs.lo[r, :k].tolist(), runs.hi[r, :k].tolist())) == row_runs


def test_block_runs_of_empty_lists():
    runs = block_runs(torch.zeros((3, 0), dtype=torch.int32, device=DEV), torch.zeros(3, dtype=torch.int32,
                                                                                      device=DEV), 2)
    assert runs.lo.shape == runs.idx.shape == (3, 1) and runs.n_runs.tolist() == runs.n_full.tolist() == [0] * 3


CASES = [  # seq, n, heads, kv heads, head dim, block size, q_start (None: the last n), dtype, selection
    (260, 260, 4, 1, 16, 16, None, torch.float32, "ragged"),  # prefill from position 0, GQA 4
    (260, 260, 4, 1, 16, 16, None, torch.float32, "mixed"),
    (301, 97, 8, 2, 16, 16, None, torch.float16, "structured"),  # chunk after an unaligned prefix, fp16
    (333, 120, 4, 2, 32, 32, 150, torch.float32, "structured"),  # queries in the middle; 2 key tiles per block
    (333, 120, 4, 2, 32, 32, 150, torch.float32, "holes"),
    (200, 77, 2, 2, 16, 16, None, torch.float32, "dense"),  # every visible block: one run per query block
]
MODES = [LoopConfig(mode="runs"), LoopConfig(mode="lists"), LoopConfig(mode="auto", run_min_tiles=3)]


@pytest.mark.parametrize("loop", MODES, ids=lambda c: c.mode)
@pytest.mark.parametrize("seq,n,h,kvh,d,bs,q_start,dtype,kind", CASES)
def test_loop_modes_match_reference(seq, n, h, kvh, d, bs, q_start, dtype, kind, loop):
    gen = torch.Generator().manual_seed(seq * 31 + n + len(kind))
    q = torch.randn(n, h, d, generator=gen).to(DEV, dtype)
    k, v = (torch.randn(seq, kvh, d, generator=gen).to(DEV, dtype) for _ in range(2))
    qs = seq - n if q_start is None else q_start
    qb0, nqb, nkb = _layout(n, seq, bs, qs)
    idx, count = block_lists_from_mask(_selection(kind, qb0, nqb, nkb, gen))
    if kind == "mixed":  # both of auto's loops run
        runs = block_runs(idx, count, qb0)
        takes_runs = runs.n_runs * loop.run_min_tiles <= runs.n_full * (bs // 16)
        assert takes_runs.any() and (~takes_runs & (runs.n_full > 0)).any()
    scale = 0.8 / math.sqrt(d)
    o, lse = block_sparse_attention(q, k, v, idx, count, bs, scale, q_start, loop=loop)
    ro, rlse = block_sparse_attention_reference(q, k, v, idx, count, bs, scale, q_start)
    tol = TOL if dtype == torch.float32 else 2e-3
    assert o.dtype == dtype and not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    finite = torch.isfinite(rlse)
    assert (lse[finite] - rlse[finite]).abs().max().item() < 10 * tol
    assert (o.float() - ro.float()).abs().max().item() < 10 * tol


@pytest.mark.parametrize("loop", MODES, ids=lambda c: c.mode)
def test_rows_whose_max_grows_along_the_keys(loop):
    # the online softmax's rescaling in each loop: q scaled up and key norms rising along the keys keep moving rows'
    # maxima from key tile to key tile
    seq, n, bs = 333, 120, 32
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(n, 4, 32, generator=gen).to(DEV)
    k, v = (torch.randn(seq, 2, 32, generator=gen).to(DEV) for _ in range(2))
    q, k = growing_row_maxima(q, k, 6.0)
    qb0, nqb, nkb = _layout(n, seq, bs, seq - n)
    idx, count = block_lists_from_mask(_selection("mixed", qb0, nqb, nkb, gen))
    o, lse = block_sparse_attention(q, k, v, idx, count, bs, 0.2, loop=loop)
    ro, rlse = block_sparse_attention_reference(q, k, v, idx, count, bs, 0.2)
    finite = torch.isfinite(rlse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse)) and not o.isnan().any()
    assert (lse[finite] - rlse[finite]).abs().max().item() < 10 * TOL
    assert (o - ro).abs().max().item() < 10 * TOL


class _Record:
    """Wraps the kernel: records the compile-time arguments of each launch."""

    def __init__(self, kernel):
        self.kernel, self.kwargs = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kwargs.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_loop_config_from_a_spec_and_as_an_argument(monkeypatch):
    assert loop_config("") == bsa_module.LOOP
    assert loop_config("mode=lists, list_stages=3") == LoopConfig(mode="lists", list_stages=3)
    for bad, match in (("mode=fast", "mode='fast'"), ("stages=3", "key=value"), ("list_stages=-1", "non-negative"),
                       ("runs", "key=value")):
        with pytest.raises(ValueError, match=match):
            loop_config(bad)
    record = _Record(bsa_module._bsa_fwd_kernel)
    monkeypatch.setattr(bsa_module, "_bsa_fwd_kernel", record)
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(40, 2, 16, generator=gen).to(DEV), torch.randn(80, 1, 16, generator=gen).to(DEV)
    idx, count = block_lists_from_mask(_selection("ragged", 2, 3, 5, gen))
    block_sparse_attention(q, k, k, idx, count, 16, loop=loop_config("mode=runs,run_min_tiles=7"))
    block_sparse_attention(q, k, k, idx, count, 16, loop=LoopConfig(mode="lists", list_stages=4))
    first, second = record.kwargs
    assert (first["LOOP_MODE"], first["RUN_MIN_TILES"]) == (bsa_module.LOOP_MODES["runs"], 7)
    assert (second["LOOP_MODE"], second["LIST_STAGES"]) == (bsa_module.LOOP_MODES["lists"], 4)


# ------------------------------------------------------------------------------------------------ GPU only
def _gpu_inputs(seq: int, n: int, kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 32, 128, generator=gen).to(DEV, torch.bfloat16)
    k, v = (torch.randn(seq, 8, 128, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    qb0, nqb, nkb = _layout(n, seq, 128, seq - n)
    return q, k, v, qb0, block_lists_from_mask(_selection(kind, qb0, nqb, nkb, gen))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ragged", "structured", "mixed"])
def test_gpu_loop_modes_bf16(kind):
    seq, n = 16384 + 77, 4096
    q, k, v, _, (idx, count) = _gpu_inputs(seq, n, kind, 3)
    ro, rlse = block_sparse_attention_reference(q, k, v, idx, count, 128, 128 ** -0.5)
    for loop in (*MODES, LoopConfig(mode="lists", list_stages=3)):
        o, lse = block_sparse_attention(q, k, v, idx, count, 128, 128 ** -0.5, loop=loop)
        err = ((o.float() - ro.float()).norm() / ro.float().norm()).item()
        assert not o.isnan().any() and err < 1e-2 and (lse - rlse).abs().max().item() < 1e-2, loop


@pytest.mark.gpu
def test_gpu_every_block_matches_the_dense_kernel_without_sync():
    seq, n = 16384, 4096
    q, k, v, _, (idx, count) = _gpu_inputs(seq, n, "dense", 4)
    do, dlse = flash_attn_with_lse(q, k, v, 128 ** -0.5, causal=True)
    for loop in MODES:
        o, lse = block_sparse_attention(q, k, v, idx, count, 128, 128 ** -0.5, loop=loop)
        assert (o.float() - do.float()).abs().max().item() < 2e-2 and (lse - dlse).abs().max().item() < 1e-3
        assert host_sync_sites(lambda loop=loop: block_sparse_attention(q, k, v, idx, count, 128, 128 ** -0.5,
                                                                        loop=loop)) == []
