"""The fused flash-decoding reduce of sparsekv.kernels.paged_attention: the last split program of each (sequence,
kv head) merges the group's partials in the split launch. It must equal merge_splits (the reduce as a kernel of
its own) over the same partials bitwise, match the reference, and leave its arrival counters at 0 (repeated
calls, CUDA-graph replays).

On CPU the kernels run under the Triton interpreter (fp32, small sizes); the GPU tests need CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparsekv.kernels import paged_decode_attention_reference, resolve_kernels
from sparsekv.kernels import paged_attention as P
from tests.kernels.test_kernels import DEV, _check_attn, _paged_case

pytestmark = pytest.mark.usefixtures("triton_kernels")


def _both(q, kc, vc, tables, lens_t, **kw):
    """(the fused call's (o, lse), merge_splits over the partials that call wrote)."""
    buffers = []  # o, lse, then (several splits) o_part [B, H, S, D], lse_part [B, H, S]
    alloc = P.alloc_output

    def keep(shape, dtype, device):
        buffers.append(alloc(shape, dtype, device))
        return buffers[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "alloc_output", keep)
        fused = P.paged_decode_attention(q, kc, vc, tables, lens_t, **kw)
    if len(buffers) == 2:
        return fused, fused  # one split: the kernel wrote o and lse directly
    o_part, lse_part = buffers[2:]
    B, H, _, D = o_part.shape
    o = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, B, dtype=torch.float32, device=q.device)
    P.merge_splits(o_part, lse_part, o, lse, H // kc.shape[2])
    return fused, (o, lse)


def _assert_bitwise(a, b) -> None:
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y), f"max |diff| {(x.float() - y.float()).abs().nan_to_num().max().item()}"


def _counters_zero(device: torch.device = DEV) -> bool:
    return all(int(buf.abs().sum()) == 0 for buf in P._COUNTERS.values())


@pytest.mark.parametrize("group,kvh", [(1, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("num_splits", [2, 3, 5, 18])  # 18 > REDUCE_CHUNK: two merge steps
def test_fused_equals_merge_splits_and_reference(group, kvh, num_splits):
    lens = [0, 1, 37, 200, 301]  # ragged: empty sequences, splits with no keys, lengths below max_context_len
    q, kc, vc, tables, lens_t, _, _ = _paged_case(lens, group * kvh, kvh, 32, 12, seed=num_splits + group)
    fused, split = _both(q, kc, vc, tables, lens_t, num_splits=num_splits, max_context_len=max(lens))
    _assert_bitwise(fused, split)
    _check_attn(fused, paged_decode_attention_reference(q, kc, vc, tables, lens_t), q.dtype)
    assert (fused[0][0] == 0).all() and torch.isneginf(fused[1][:, 0]).all()
    assert _counters_zero()


def test_fused_default_plan_and_single_split():
    lens = [70, 5, 129]
    q, kc, vc, tables, lens_t, _, _ = _paged_case(lens, 8, 2, 64, 16, seed=3)
    ref = paged_decode_attention_reference(q, kc, vc, tables, lens_t, softmax_scale=0.2)
    for kw in ({}, {"num_splits": 1}, {"max_context_len": 40, "num_splits": 2}):  # 40 < 129: split from each length
        fused, split = _both(q, kc, vc, tables, lens_t, softmax_scale=0.2, **kw)
        _assert_bitwise(fused, split)
        _check_attn(fused, ref, q.dtype)
    assert _counters_zero()


def test_grid_planned_for_a_long_context_splits_short_ones_evenly(monkeypatch):
    """The engine plans the grid from max_model_len (fixed for CUDA graphs); each sequence cuts its own context into
    min(num_splits, len / min_split_tokens) splits, so a short one still spreads over several programs."""
    lens = [0, 40, 130, 301]
    q, kc, vc, tables, lens_t, _, _ = _paged_case(lens, 8, 2, 32, 12, seed=11)
    ref = paged_decode_attention_reference(q, kc, vc, tables, lens_t)
    kw = dict(max_context_len=4096, num_splits=64, min_split_tokens=64)
    out = P.paged_decode_attention(q, kc, vc, tables, lens_t, **kw)
    _check_attn(out, ref, q.dtype)
    # the partials of the longest sequence: 301 keys over ceil(301 / 64) = 5 splits of 64, the other 59 empty
    lse_part = torch.full((4, 8, 64), float("nan"), device=q.device)
    monkeypatch.setattr(P, "alloc_output", lambda shape, dtype, device: (
        lse_part if tuple(shape) == (4, 8, 64) else torch.empty(shape, dtype=dtype, device=device)))
    P.paged_decode_attention(q, kc, vc, tables, lens_t, **kw)
    assert torch.isfinite(lse_part[3, :, :5]).all() and torch.isneginf(lse_part[3, :, 5:]).all()
    assert torch.isfinite(lse_part[1, :, :1]).all() and torch.isneginf(lse_part[1, :, 1:]).all()  # 40 keys: one
    assert _counters_zero()


def test_fused_repeated_calls_reset_counters():
    lens = [300, 250, 160, 64]  # a sequence's blocks are allocated for these: later lengths stay within
    q, kc, vc, tables, lens_t, _, _ = _paged_case(lens, 8, 2, 32, 16, seed=7)
    g = torch.Generator().manual_seed(0)
    for new_lens in ([300, 250, 160, 64], [299, 0, 33, 64], [1, 1, 160, 17]):
        lens_t.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=g))
        fused, split = _both(q, kc, vc, tables, lens_t, num_splits=4, max_context_len=300)
        assert _counters_zero()
        _assert_bitwise(fused, split)
        _check_attn(fused, paged_decode_attention_reference(q, kc, vc, tables, lens_t), q.dtype)


def test_merge_splits_group_invariant():
    g = torch.Generator().manual_seed(1)
    B, H, S, D = 3, 8, 5, 32
    o_part = torch.randn(B, H, S, D, generator=g).to(DEV)
    lse_part = torch.randn(B, H, S, generator=g).to(DEV)
    lse_part[0, :, 1:] = float("-inf")  # one live split
    lse_part[1, 2] = float("-inf")  # a head with no keys
    outs = []
    for group in (1, 2, 8):
        o = torch.empty(B, H, D, device=DEV)
        lse = torch.empty(H, B, device=DEV)
        P.merge_splits(o_part, lse_part, o, lse, group)
        outs.append((o, lse))
    for other in outs[1:]:
        _assert_bitwise(outs[0], other)
    o, lse = outs[0]
    w = torch.softmax(lse_part * 0.6931471805599453, dim=-1).nan_to_num()  # [B, H, S]
    assert torch.allclose(o, (w[..., None] * o_part).sum(2), atol=1e-5)
    assert (o[1, 2] == 0).all() and torch.isneginf(lse[2, 1])
    with pytest.raises(ValueError, match="group=3"):
        P.merge_splits(o_part, lse_part, o, lse, 3)


def test_counter_slots_limit(monkeypatch):
    # contexts of several GPU tiles (64 keys at D = 32; the interpreter's are 32): two splits, not one direct pass
    q, kc, vc, tables, lens_t, _, _ = _paged_case([500, 600], 4, 2, 32, 16)
    monkeypatch.setattr(P, "COUNTER_SLOTS", 3)  # B * KVH = 4
    with pytest.raises(ValueError, match="COUNTER_SLOTS=3"):
        P.paged_decode_attention(q, kc, vc, tables, lens_t, num_splits=2)


# ------------------------------------------------------------------ GPU only
def _bf16_case(lens, h=32, kvh=8, block_size=16, seed=0):
    return _paged_case(lens, h, kvh, 128, block_size, torch.bfloat16, seed=seed)


@pytest.fixture(params=[False, True], ids=["nopdl", "pdl"])
def kernels(request):
    """The CUDA kernel choice with PDL off, and as resolved (on where the GPU has it)."""
    resolved = resolve_kernels(DEV, backend="triton")
    return resolved if request.param else dataclasses.replace(resolved, pdl=False)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[4096], [32768], [0, 1, 5000, 17, 70000, 4096, 333, 12345]])
def test_gpu_fused_bitwise_bf16(lens, kernels):
    q, kc, vc, tables, lens_t, _, _ = _bf16_case(lens)
    for splits in (None, 7, 64):
        fused, split = _both(q, kc, vc, tables, lens_t, max_context_len=max(lens), num_splits=splits,
                             kernels=kernels)
        _assert_bitwise(fused, split)
        _check_attn(fused, paged_decode_attention_reference(q, kc, vc, tables, lens_t), torch.bfloat16)
    torch.cuda.synchronize()
    assert _counters_zero()


@pytest.mark.gpu
def test_gpu_fused_cuda_graph_replay(kernels):
    # Several layers back to back in one graph (one counter buffer), replayed after q / context_lens change in
    # place: every replay equals the eager call and merge_splits bitwise (same plan: max_context_len fixed).
    layers = [_bf16_case([4096, 700, 4096], seed=i) for i in range(4)]  # later lengths stay within these
    q, _, _, tables, lens_t, _, _ = layers[0]
    caches = [(kc, vc) for _, kc, vc, *_ in layers]
    call = lambda kc, vc: P.paged_decode_attention(q, kc, vc, tables, lens_t, max_context_len=4096,  # noqa: E731
                                                   kernels=kernels)
    for kc, vc in caches:
        call(kc, vc)  # compile, and make the counters outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call(kc, vc) for kc, vc in caches]
    for new_lens in ([4096, 700, 4096], [2999, 1, 4000], [0, 650, 17], [4095, 700, 1]):
        lens_t.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert _counters_zero()
        for (o, lse), (kc, vc) in zip(outs, caches):
            eager, two = _both(q, kc, vc, tables, lens_t, max_context_len=4096, kernels=kernels)
            _assert_bitwise((o.clone(), lse.clone()), eager)
            _assert_bitwise(eager, two)
            _check_attn((o, lse), paged_decode_attention_reference(q, kc, vc, tables, lens_t), torch.bfloat16)
