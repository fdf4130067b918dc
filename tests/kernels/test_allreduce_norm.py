"""kernels/allreduce_norm.py: a row-parallel layer's fp32 partials summed over the ranks through peer buffers, with
the bias, the residual add and the next RMSNorm, in one launch.

Ranks are emulated in one process: every rank's buffer is an ordinary tensor and PeerBuffers holds their addresses.
On one stream (the interpreter, or a GPU) the ranks run one after another, so the ranks that have not run yet have
their arrival written beforehand, as their kernels leave it before they wait (data in the call's slot, flags raised).
On a GPU the ranks also run concurrently on their own streams, eagerly and inside CUDA graphs, with nothing
written for them.
"""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import allreduce_norm as AR
from sparsekv.kernels.allreduce_norm import (
    MAX_ROWS,
    PeerBuffers,
    all_reduce_add_rms_norm,
    all_reduce_add_rms_norm_reference,
    buffer_bytes,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.usefixtures("triton_kernels", "one_thread")


class EmulatedRanks:
    """`world` ranks' buffers on one device and each rank's PeerBuffers."""

    def __init__(self, world: int):
        self.world = world
        self.buffers = [torch.zeros(buffer_bytes(world) // 4, dtype=torch.int32, device=DEV) for _ in range(world)]
        pointers = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=DEV)
        self.peers = [PeerBuffers(pointers, torch.zeros(MAX_ROWS, dtype=torch.int32, device=DEV), rank, world)
                      for rank in range(world)]

    def flags(self, rank: int) -> torch.Tensor:
        return self.buffers[rank][:self.world * MAX_ROWS].view(self.world, MAX_ROWS)  # [from rank, row]

    def data(self, rank: int) -> torch.Tensor:
        return self.buffers[rank][AR._flag_ints(self.world):].view(torch.float32).view(2, MAX_ROWS, AR.MAX_WIDTH)

    def arrive(self, rank: int, call: int, partials: torch.Tensor) -> None:
        """What rank's kernel leaves before it waits in call number `call`: its split sum, its flags raised."""
        splits, m, n = partials.shape
        local = torch.zeros(m, n, device=DEV)
        for s in range(splits):  # split order, as the kernel
            local += partials[s]
        self.data(rank)[call % 2, :m, :n] = local
        for other in range(self.world):
            if other != rank:
                self.flags(other)[rank, :m] = call


def _inputs(world: int, splits: int, m: int, n: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(splits, m, n, generator=g).to(DEV) for _ in range(world)]  # [S, M, N] fp32 per rank
    residual = torch.randn(m, n, generator=g).to(DEV, dtype)
    norm_w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    return partials, b, residual, norm_w


def _run_in_turn(ranks: EmulatedRanks, call: int, partials, b, residual, norm_w):
    for rank in range(1, ranks.world):
        ranks.arrive(rank, call, partials[rank])
    return [all_reduce_add_rms_norm(partials[r], b, residual, norm_w, 1e-6, ranks.peers[r])
            for r in range(ranks.world)]


def _assert_matches(outs, partials, b, residual, norm_w, dtype):
    want_normed, want_residual = all_reduce_add_rms_norm_reference(partials, b, residual, norm_w, 1e-6)
    # bf16: a 1-ulp difference of the rounded sum (the interpreter's rounding) moves the residual by up to ~0.06
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (8e-2, 2e-2)
    for normed, new_residual in outs:
        assert not normed.isnan().any() and not new_residual.isnan().any()
        # every rank holds the same bits: the ranks' tokens must agree
        assert torch.equal(normed, outs[0][0]) and torch.equal(new_residual, outs[0][1])
        torch.testing.assert_close(new_residual.float(), want_residual.float(), atol=atol, rtol=rtol)
        torch.testing.assert_close(normed.float(), want_normed.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("world, splits, m, n, bias", [(2, 1, 1, 96, False), (2, 3, 3, 100, True),
                                                       (3, 2, 2, 64, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sum_over_ranks_matches_reference_over_calls(world, splits, m, n, bias, dtype):
    """Four calls: the data slots alternate, the flags and counters advance to the call number."""
    ranks = EmulatedRanks(world)
    for call in range(1, 5):
        inputs = _inputs(world, splits, m, n, dtype, seed=call, bias=bias)
        outs = _run_in_turn(ranks, call, *inputs)
        _assert_matches(outs, *inputs, dtype)
        for rank in range(world):
            assert ranks.peers[rank].counters[:m].tolist() == [call] * m
            assert ranks.peers[rank].counters[m:].eq(0).all()  # rows past M untouched
            others = [o for o in range(world) if o != rank]
            assert ranks.flags(rank)[others, :m].eq(call).all()


def test_call_numbers_wrap_and_keep_alternating_slots():
    """At the wrap the call number returns to 1 (slot 1) after COUNTER_WRAP (slot 0)."""
    ranks = EmulatedRanks(2)
    for rank in range(2):
        ranks.peers[rank].counters.fill_(AR.COUNTER_WRAP)
        ranks.flags(rank).fill_(AR.COUNTER_WRAP)
    inputs = _inputs(2, 2, 2, 64, torch.float32, seed=5, bias=False)
    outs = _run_in_turn(ranks, 1, *inputs)
    _assert_matches(outs, *inputs, torch.float32)
    assert ranks.peers[0].counters[:2].tolist() == [1, 1]
    assert AR.COUNTER_WRAP % 2 == 0


def test_bad_inputs_name_the_value_and_the_fix():
    ranks = EmulatedRanks(2)
    partials, b, residual, norm_w = _inputs(2, 1, 2, 64, torch.float32, seed=1, bias=True)
    peers = ranks.peers[0]
    with pytest.raises(ValueError, match=r"contiguous fp32 partials \[S, M, N\].*torch.bfloat16"):
        all_reduce_add_rms_norm(partials[0].bfloat16(), b, residual, norm_w, 1e-6, peers)
    with pytest.raises(ValueError, match=r"residual must be \[M=2, N=64\]"):
        all_reduce_add_rms_norm(partials[0], b, residual[:, :32], norm_w, 1e-6, peers)
    with pytest.raises(ValueError, match=r"bias must be \[N=64\]"):
        all_reduce_add_rms_norm(partials[0], b[:8], residual, norm_w, 1e-6, peers)
    too_many = torch.zeros(1, MAX_ROWS + 1, 64, device=DEV)
    with pytest.raises(ValueError, match=rf"M={MAX_ROWS + 1} rows .*\(at most {MAX_ROWS} rows"):
        all_reduce_add_rms_norm(too_many, None, torch.zeros(MAX_ROWS + 1, 64, device=DEV), norm_w, 1e-6, peers)
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        PeerBuffers(peers.pointers, peers.counters, 2, 2)
    with pytest.raises(ValueError, match=r"pointers must be int64 \[world=2\]"):
        PeerBuffers(peers.pointers.int(), peers.counters, 0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_gpu_ranks_on_concurrent_streams(graphed):
    """Two ranks on two streams of one GPU, 40 calls each with nothing written for them: the flags alone order them.
    Graphed, both ranks' calls are one CUDA graph (a branch per stream), replayed twice: the counters carry on
    across replays. A first call in turn loads both ranks' kernels (rank 1 is its own specialization): loading a
    module while the other rank's kernel spins would wait for that kernel, which waits for this one."""
    world, calls, m, n = 2, 40, 4, 4096
    ranks = EmulatedRanks(world)
    g = torch.Generator(device=DEV).manual_seed(0)
    partials = [[torch.randn(2, m, n, device=DEV, generator=g) for _ in range(world)] for _ in range(calls)]
    residual = torch.randn(m, n, device=DEV, generator=g).bfloat16()
    norm_w = torch.randn(n, device=DEV, generator=g).bfloat16()
    outs = [[None] * calls for _ in range(world)]

    def issue(rank: int) -> None:
        for c in range(calls):
            outs[rank][c] = all_reduce_add_rms_norm(partials[c][rank], None, residual, norm_w, 1e-6,
                                                    ranks.peers[rank], pdl=True)

    for rank in range(1, world):
        ranks.arrive(rank, 1, partials[0][rank])
    for rank in range(world):
        all_reduce_add_rms_norm(partials[0][rank], None, residual, norm_w, 1e-6, ranks.peers[rank], pdl=True)
    torch.cuda.synchronize()

    def both_ranks() -> None:
        main = torch.cuda.current_stream()
        streams = [torch.cuda.Stream() for _ in range(world)]
        for rank, stream in enumerate(streams):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                issue(rank)
        for stream in streams:
            main.wait_stream(stream)

    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            both_ranks()
        for _ in range(2):
            graph.replay()
        expected = 1 + 2 * calls
    else:
        both_ranks()
        expected = 1 + calls
    torch.cuda.synchronize()
    assert [p.counters[:m].tolist() for p in ranks.peers] == [[expected] * m] * world
    for c in range(calls):
        _assert_matches([outs[r][c] for r in range(world)], partials[c], None, residual, norm_w, torch.bfloat16)
