"""block_select.select_block_runs (two Triton launches: threshold per KV head, then vote, lists and runs) against its
pure-torch reference (threshold_keep, block_lists_from_mask, block_runs). Masses are multiples of 1/1024 so every
sum is exact in fp32 and kernel and reference must agree bit for bit, ties included."""

from __future__ import annotations

import pytest
import torch

from sparsekv.policies.xattn import block_select
from sparsekv.policies.xattn.block_select import select_block_runs, select_block_runs_reference, threshold_keep
from tests.conftest import CountLaunches, compiled_variants

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.usefixtures("triton_kernels", "one_thread")


def _masses(kv_heads: int, nqb: int, nkb: int, gen: torch.Generator, levels: int = 64) -> torch.Tensor:
    """Dyadic masses with ties and zeros: a few levels, many blocks at 0."""
    mass = torch.randint(0, levels, (kv_heads, nqb, nkb), generator=gen).float() / 1024
    mass[torch.rand(mass.shape, generator=gen) < 0.3] = 0.0
    return mass.to(DEV)


def _assert_same(got, want) -> None:
    (runs, count), (ref, ref_count) = got, want
    assert torch.equal(count.cpu(), ref_count.cpu())
    for name in ("n_full", "n_runs", "diag"):
        assert torch.equal(getattr(runs, name).cpu(), getattr(ref, name).cpu()), name
    for r in range(count.shape[0]):
        kept, n_runs = int(ref_count[r]), int(ref.n_runs[r])
        assert torch.equal(runs.idx[r, :kept].cpu(), ref.idx[r, :kept].cpu()), f"list of query block {r}"
        assert torch.equal(runs.lo[r, :n_runs].cpu(), ref.lo[r, :n_runs].cpu()), f"run starts of query block {r}"
        assert torch.equal(runs.hi[r, :n_runs].cpu(), ref.hi[r, :n_runs].cpu()), f"run ends of query block {r}"


@pytest.mark.parametrize("kv_heads,nqb,nkb,qb0,threshold,need", [
    (2, 5, 9, 4, 0.7, 1),  # one tile per row
    (4, 6, 40, 34, 0.6, 2),  # rows over three 16-block tiles under the interpreter: carries across tiles
    (3, 7, 7, 0, 0.9, 3),  # the whole prompt: the first query block sees only the sink
    (1, 3, 33, 30, 0.5, 1),  # one KV head, a row ending one past a tile
])
def test_kernel_matches_reference(kv_heads, nqb, nkb, qb0, threshold, need):
    gen = torch.Generator().manual_seed(nkb * 7 + qb0)
    mass = _masses(kv_heads, nqb, nkb, gen)
    _assert_same(select_block_runs(mass, qb0, threshold, need), select_block_runs_reference(mass, qb0, threshold,
                                                                                             need))


def test_kernel_runs_two_launches_and_keeps_runs_of_consecutive_blocks(monkeypatch):
    threshold_launches = CountLaunches(block_select._threshold_kernel)
    runs_launches = CountLaunches(block_select._runs_kernel)
    monkeypatch.setattr(block_select, "_threshold_kernel", threshold_launches)
    monkeypatch.setattr(block_select, "_runs_kernel", runs_launches)
    # one KV head, query block 20 (the last of 21 key blocks): a heavy band 5..9 and block 14; the rest light
    mass = torch.full((1, 1, 21), 1 / 1024)
    mass[0, 0, 5:10] = 0.25
    mass[0, 0, 14] = 0.5
    runs, count = select_block_runs(mass.to(DEV), 20, 0.8, 1)
    assert (threshold_launches.calls, runs_launches.calls) == (1, 1)
    assert runs.idx[0, :int(count[0])].tolist() == [0, 5, 6, 7, 8, 9, 14, 20]  # + the sink and the diagonal
    assert int(runs.n_full[0]) == 7 and int(runs.diag[0]) == 1 and int(runs.n_runs[0]) == 3
    assert runs.lo[0, :3].tolist() == [0, 5, 14] and runs.hi[0, :3].tolist() == [1, 10, 15]


def test_rows_without_mass_keep_only_the_sink_and_the_diagonal():
    mass = torch.zeros(2, 3, 6, device=DEV)
    runs, count = select_block_runs(mass, 3, 0.7, 1)
    assert count.tolist() == [2, 2, 2]
    assert [runs.idx[r, :2].tolist() for r in range(3)] == [[0, 3], [0, 4], [0, 5]]
    _assert_same((runs, count), select_block_runs_reference(mass, 3, 0.7, 1))


def test_threshold_keeps_tied_blocks_together():
    mass = torch.tensor([[[0.25, 0.25, 0.25, 0.25]]])
    assert threshold_keep(mass, 0.3).tolist() == [[[True, True, True, True]]]  # no order among equals
    mass = torch.tensor([[[0.5, 0.2, 0.2, 0.1]]])
    assert threshold_keep(mass, 0.6).tolist() == [[[True, True, True, False]]]
    runs, count = select_block_runs(torch.tensor([[[0.5, 0.25, 0.25, 0.0]]], device=DEV), 3, 0.6, 1)
    assert runs.idx[0, :int(count[0])].tolist() == [0, 1, 2, 3]


def test_threshold_one_keeps_every_visible_block():
    runs, count = select_block_runs(torch.zeros(2, 2, 4, device=DEV), 2, 1.0, 2)
    assert count.tolist() == [3, 4] and runs.n_runs.tolist() == [1, 1] and runs.hi[:, 0].tolist() == [2, 3]


def test_bad_inputs_name_the_value():
    mass = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="float32"):
        select_block_runs(mass.double(), 2, 0.7, 1)
    with pytest.raises(ValueError, match="qb0=3"):
        select_block_runs(mass, 3, 0.7, 1)
    with pytest.raises(ValueError, match="threshold=0"):
        select_block_runs(mass, 2, 0, 1)
    with pytest.raises(ValueError, match="need=3"):
        select_block_runs(mass, 2, 0.7, 3)


@pytest.mark.gpu
def test_gpu_kernel_matches_reference_at_real_size():
    """A 16K-query chunk at the end of 512K keys in 128-token blocks (Qwen3-4B's 8 KV heads): 4,096 key blocks per
    row, two tiles."""
    gen = torch.Generator().manual_seed(5)
    mass = _masses(8, 128, 4096, gen, levels=1024)
    for threshold, need in ((0.7, 4), (0.9, 1)):
        _assert_same(select_block_runs(mass, 3968, threshold, need),
                     select_block_runs_reference(mass, 3968, threshold, need))


@pytest.mark.gpu
def test_gpu_one_compiled_kernel_serves_every_chunk_of_a_prompt():
    """Rows grow with every chunk (64 key blocks after the first 8K, 1,024 at 128K, 4,096 at 512K): no chunk
    compiles a new variant in the middle of a prefill."""
    gen = torch.Generator().manual_seed(6)
    kernels = (block_select._threshold_kernel, block_select._runs_kernel)
    select_block_runs(_masses(8, 64, 64, gen), 0, 0.7, 4)
    before = [compiled_variants(kernel) for kernel in kernels]
    for nkb in (128, 1024, 1056, 4096):
        select_block_runs(_masses(8, 64, nkb, gen), nkb - 64, 0.7, 4)
    assert [compiled_variants(kernel) for kernel in kernels] == before
