"""Tests of sparsekv.kernels: Triton kernels against their pure-torch references.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by conftest before triton is
imported; the `triton_kernels` fixture asks for them). The interpreter mishandles bf16 tl.dot, so CPU tests use
fp32; bf16 is covered by the GPU tests.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsekv.kernels import (
    KernelChoice,
    _dispatch,
    flash_attn_with_lse,
    flash_attn_with_lse_reference,
    merge_attention_outputs,
    merge_attention_outputs_reference,
    paged_decode_attention,
    paged_decode_attention_reference,
    resolve_kernels,
    store_kv,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEG_INF = float("-inf")


pytestmark = pytest.mark.usefixtures("triton_kernels")


def _tol(dtype: torch.dtype) -> float:
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2
    return 3e-3 if DEV.type == "cuda" else 1e-4  # tf32 tl.dot on GPU


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _check_lse(lse: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert lse.dtype == torch.float32 and lse.shape == ref.shape
    assert not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert torch.isfinite(lse[finite]).all()
    if finite.any():
        assert (lse[finite] - ref[finite]).abs().max().item() < atol


def _check_attn(out, ref, dtype) -> None:
    o, lse = out
    ro, rlse = ref
    assert o.shape == ro.shape and o.dtype == ro.dtype
    assert not o.isnan().any()
    if ro.float().norm() > 0:
        assert _rel_err(o, ro) < _tol(dtype)
    else:
        assert o.float().abs().max().item() == 0.0
    _check_lse(lse, rlse, atol=20 * _tol(dtype))


def _qkv(sq, sk, h, kvh, d, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(sq, h, d), mk(sk, kvh, d), mk(sk, kvh, d)


# ------------------------------------------------------------------ flash_attn_with_lse
SHAPES = [(33, 33), (16, 16), (19, 50), (50, 19), (1, 45), (40, 1)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_attention_matches_reference(causal, sq, sk, group):
    q, k, v = _qkv(sq, sk, 4, 4 // group, 32, seed=sq * 1000 + sk)
    ref = flash_attn_with_lse_reference(q, k, v, causal=causal)
    _check_attn(flash_attn_with_lse(q, k, v, causal=causal), ref, q.dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(24, 40), (40, 24)])
def test_attention_head_dim_64_and_scale(causal, sq, sk):
    q, k, v = _qkv(sq, sk, 4, 2, 64, seed=7)
    ref = flash_attn_with_lse_reference(q, k, v, softmax_scale=0.3, causal=causal)
    _check_attn(flash_attn_with_lse(q, k, v, softmax_scale=0.3, causal=causal), ref, q.dtype)


def test_attention_causal_offset_sweep():
    # Every alignment of the causal diagonal against 16-wide key blocks (the interpreter's
    # block size), so the masked/unmasked split of the key loop is hit at each boundary.
    for off in range(-3, 19):
        q, k, v = _qkv(18, 18 + off, 2, 1, 32, seed=100 + off)
        ref = flash_attn_with_lse_reference(q, k, v, causal=True)
        _check_attn(flash_attn_with_lse(q, k, v, causal=True), ref, q.dtype)


def test_attention_empty_rows_when_sq_exceeds_sk():
    q, k, v = _qkv(30, 10, 2, 1, 32, seed=3)
    o, lse = flash_attn_with_lse(q, k, v, causal=True)
    # Query i sees keys j <= i - 20: the first 20 rows see nothing.
    assert torch.isneginf(lse[:, :20]).all() and torch.isfinite(lse[:, 20:]).all()
    assert (o[:20] == 0).all()
    _check_attn((o, lse), flash_attn_with_lse_reference(q, k, v, causal=True), q.dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_zero_keys_and_zero_queries(causal):
    q, k, v = _qkv(5, 0, 4, 2, 32)
    o, lse = flash_attn_with_lse(q, k, v, causal=causal)
    assert o.shape == (5, 4, 32) and (o == 0).all()
    assert lse.shape == (4, 5) and torch.isneginf(lse).all()
    ro, rlse = flash_attn_with_lse_reference(q, k, v, causal=causal)
    assert (ro == 0).all() and torch.isneginf(rlse).all()
    q, k, v = _qkv(0, 7, 4, 2, 32)
    o, lse = flash_attn_with_lse(q, k, v, causal=causal)
    assert o.shape == (0, 4, 32) and lse.shape == (4, 0)


def test_attention_non_contiguous_inputs():
    # q, k, v sliced out of one packed projection: strided along the leading dim.
    h, kvh, d, s = 4, 2, 32, 37
    qkv = torch.randn(s, h + 2 * kvh, d, device=DEV)
    q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
    assert not q.is_contiguous()
    ref = flash_attn_with_lse_reference(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    _check_attn(flash_attn_with_lse(q, k, v, causal=True), ref, q.dtype)


def test_attention_bad_shapes_raise():
    q, k, v = _qkv(8, 8, 4, 2, 32)
    with pytest.raises(ValueError, match=r"\(8, 3, 32\)"):
        flash_attn_with_lse(q[:, :3], k, v)  # H=3 not a multiple of KVH=2
    with pytest.raises(ValueError, match=r"\(8, 2, 16\)"):
        flash_attn_with_lse(q, k[..., :16], v[..., :16])
    with pytest.raises(ValueError, match=r"\(8, 2, 32\).*\(7, 2, 32\)"):
        flash_attn_with_lse(q, k, v[:7])
    with pytest.raises(ValueError, match=r"\[Sq, H, D\]"):
        flash_attn_with_lse(q[0], k, v)
    with pytest.raises(ValueError, match="dtype"):
        flash_attn_with_lse(q.double(), k, v)
    if _dispatch.attention_backend("triton", q.dtype, False, 8, 8, 48) == "triton":
        q3, k3, v3 = _qkv(8, 8, 4, 2, 48)
        with pytest.raises(ValueError, match="D=48"):
            flash_attn_with_lse(q3, k3, v3)


def test_attention_backend_override(monkeypatch):
    assert resolve_kernels(DEV, backend="torch") == KernelChoice.torch_reference()
    with pytest.raises(ValueError, match="bogus"):
        resolve_kernels(DEV, backend="bogus")
    monkeypatch.setenv(_dispatch.ENV_BACKEND, "torch")  # the one environment switch, read by resolve_kernels
    assert resolve_kernels(DEV) == KernelChoice.torch_reference()
    q, k, v = _qkv(9, 12, 4, 2, 32)
    ref = flash_attn_with_lse_reference(q, k, v, causal=True)
    out = flash_attn_with_lse(q, k, v, causal=True, kernels=KernelChoice.torch_reference())
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_a_forced_backend_that_cannot_run_on_the_cpu_says_so(monkeypatch, caplog):
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    monkeypatch.setattr("sparsekv.kernels.backend.INTERPRET", False)
    with caplog.at_level("WARNING", logger="sparsekv.kernels.backend"):
        assert resolve_kernels("cpu", backend="triton") == KernelChoice.torch_reference()
        assert resolve_kernels("cpu", backend="sdpa") == KernelChoice.torch_reference()
        assert resolve_kernels("cpu", backend="torch") == KernelChoice.torch_reference()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "TRITON_INTERPRET=1" in messages[0] and "sdpa needs CUDA" in messages[1]


# ------------------------------------------------------------------ merge
def _partials(n, h, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    o1, o2 = (torch.randn(n, h, d, generator=g).to(DEV, dtype) for _ in range(2))
    l1, l2 = (3 * torch.randn(h, n, generator=g).to(DEV) for _ in range(2))
    l1[0, : n // 2] = NEG_INF  # only lse1 empty
    l2[1, n // 3:] = NEG_INF  # only lse2 empty
    l1[2, ::2] = NEG_INF
    l2[2, ::2] = NEG_INF  # both empty
    o1[: n // 2, 0] = float("nan")  # an empty partial's output must be ignored
    o2[::2, 2] = float("nan")
    return o1, l1, o2, l2


@pytest.mark.parametrize("n,h,d", [(9, 4, 32), (5, 3, 24), (1, 6, 128)])
def test_merge_matches_reference(n, h, d):
    o1, l1, o2, l2 = _partials(n, h, d, seed=n)
    o, lse = merge_attention_outputs(o1, l1, o2, l2)
    ro, rlse = merge_attention_outputs_reference(o1, l1, o2, l2)
    assert not o.isnan().any() and not ro.isnan().any() and not lse.isnan().any()
    assert (o[::2, 2] == 0).all() and torch.isneginf(lse[2, ::2]).all()
    assert torch.allclose(o, ro, rtol=1e-5, atol=1e-6)
    _check_lse(lse, rlse, atol=1e-5)
    assert torch.allclose(rlse, torch.logaddexp(l1, l2), equal_nan=False)


def test_merge_with_one_side_empty_is_identity():
    o1, l1, _, _ = _partials(6, 4, 32)
    o1, l1 = torch.randn_like(o1), torch.randn_like(l1)
    o2 = torch.full_like(o1, float("nan"))
    l2 = torch.full_like(l1, NEG_INF)
    o, lse = merge_attention_outputs(o1, l1, o2, l2)
    assert torch.equal(lse, l1) and torch.allclose(o, o1, rtol=1e-6, atol=0)
    o, lse = merge_attention_outputs(o2, l2, o1, l1)
    assert torch.equal(lse, l1) and torch.allclose(o, o1, rtol=1e-6, atol=0)


def test_merge_bad_shapes_raise():
    o1, l1, o2, l2 = _partials(6, 4, 32)
    with pytest.raises(ValueError, match=r"\(6, 4\)"):
        merge_attention_outputs(o1, l1.T, o2, l2)
    with pytest.raises(ValueError, match=r"\(5, 4, 32\)"):
        merge_attention_outputs(o1, l1, o2[:5], l2)
    with pytest.raises(ValueError, match="float32"):
        merge_attention_outputs(o1, l1.double(), o2, l2)


@pytest.mark.parametrize("split", [0, 13, 30])
def test_attention_over_concat_equals_merge(split):
    q, k, v = _qkv(11, 30, 4, 2, 32, seed=split)
    a1 = flash_attn_with_lse(q, k[:split], v[:split])
    a2 = flash_attn_with_lse(q, k[split:], v[split:])
    merged = merge_attention_outputs(*a1[:1], a1[1], *a2)
    _check_attn(merged, flash_attn_with_lse_reference(q, k, v), q.dtype)


def test_chunked_prefill_equals_prefix_merge():
    # Causal chunk over [prefix; chunk] == merge(attn(q, prefix), causal attn(q, chunk)).
    q, k, v = _qkv(21, 21 + 35, 4, 1, 32, seed=5)
    prefix = flash_attn_with_lse(q, k[:35], v[:35], causal=False)
    chunk = flash_attn_with_lse(q, k[35:], v[35:], causal=True)
    merged = merge_attention_outputs(prefix[0], prefix[1], chunk[0], chunk[1])
    _check_attn(merged, flash_attn_with_lse_reference(q, k, v, causal=True), q.dtype)


# ------------------------------------------------------------------ paged decode
def _paged_case(lens, h, kvh, d, block_size, dtype=torch.float32, seed=0):
    """Contiguous per-sequence K/V plus the same data scattered into a paged cache."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 3
    max_blocks = max(used + [1]) + 2
    perm = torch.randperm(num_blocks, generator=g)
    # Unused entries are -1 or garbage ids far out of range: the kernel must not read them.
    tables = torch.randint(10**6, 10**7, (b, max_blocks), generator=g, dtype=torch.int32)
    tables[:, ::2] = -1
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(DEV, dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(DEV, dtype)
    q = torch.randn(b, h, d, generator=g).to(DEV, dtype)
    ks, vs, start = [], [], 0
    for i, n in enumerate(lens):
        tables[i, : used[i]] = perm[start:start + used[i]].int()
        start += used[i]
        k = torch.randn(n, kvh, d, generator=g).to(DEV, dtype)
        v = torch.randn(n, kvh, d, generator=g).to(DEV, dtype)
        blk = tables[i, torch.arange(n) // block_size].long()
        slots = (blk * block_size + torch.arange(n) % block_size).to(DEV)
        store_kv(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, tables.to(DEV), lens_t, ks, vs


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_paged_decode_matches_references(group, block_size, num_splits):
    lens = [0, 1, 37, 100, 300]
    q, kc, vc, tables, lens_t, ks, vs = _paged_case(lens, 4, 4 // group, 32, block_size,
                                                    seed=block_size + group)
    o, lse = paged_decode_attention(q, kc, vc, tables, lens_t, num_splits=num_splits,
                                    max_context_len=max(lens))
    ro, rlse = paged_decode_attention_reference(q, kc, vc, tables, lens_t)
    _check_attn((o, lse), (ro, rlse), q.dtype)
    assert (o[0] == 0).all() and torch.isneginf(lse[:, 0]).all()
    for b, n in enumerate(lens):  # against dense attention on the contiguous K/V
        do, dlse = flash_attn_with_lse_reference(q[b][None], ks[b], vs[b])
        _check_attn((o[b][None], lse[:, b:b + 1]), (do, dlse), q.dtype)


def test_paged_decode_head_dim_64_scale_and_host_max():
    lens = [70, 5, 129]
    q, kc, vc, tables, lens_t, _, _ = _paged_case(lens, 8, 2, 64, 16, seed=11)
    ref = paged_decode_attention_reference(q, kc, vc, tables, lens_t, softmax_scale=0.2)
    _check_attn(paged_decode_attention(q, kc, vc, tables, lens_t, 0.2), ref, q.dtype)
    # An underestimated max_context_len is still correct (the last split takes the rest).
    out = paged_decode_attention(q, kc, vc, tables, lens_t, 0.2, max_context_len=40, num_splits=2)
    _check_attn(out, ref, q.dtype)


def test_paged_decode_all_empty():
    q, kc, vc, tables, lens_t, _, _ = _paged_case([0, 0], 4, 2, 32, 16)
    o, lse = paged_decode_attention(q, kc, vc, tables, lens_t)
    assert (o == 0).all() and torch.isneginf(lse).all() and lse.shape == (4, 2)


def test_paged_decode_merges_with_dense_chunk():
    # lse layout [H, B] composes with merge_attention_outputs: paged prefix + dense suffix.
    lens = [50, 23]
    q, kc, vc, tables, lens_t, ks, vs = _paged_case(lens, 4, 2, 32, 16, seed=4)
    extra_k, extra_v = torch.randn(2, 9, 2, 32, device=DEV), torch.randn(2, 9, 2, 32, device=DEV)
    paged = paged_decode_attention(q, kc, vc, tables, lens_t, num_splits=2)
    dense = [flash_attn_with_lse(q[b][None], extra_k[b], extra_v[b]) for b in range(2)]
    dense_o = torch.cat([d[0] for d in dense])
    dense_lse = torch.cat([d[1] for d in dense], dim=1)
    o, lse = merge_attention_outputs(paged[0], paged[1], dense_o, dense_lse)
    for b in range(2):
        ref = flash_attn_with_lse_reference(
            q[b][None], torch.cat([ks[b], extra_k[b]]), torch.cat([vs[b], extra_v[b]]))
        _check_attn((o[b][None], lse[:, b:b + 1]), ref, q.dtype)


def test_paged_decode_bad_shapes_raise():
    q, kc, vc, tables, lens_t, _, _ = _paged_case([5, 9], 4, 2, 32, 16)
    with pytest.raises(ValueError, match=r"\(2, 3, 32\)"):
        paged_decode_attention(q[:, :3], kc, vc, tables, lens_t)
    with pytest.raises(ValueError, match=r"block_tables.*\(1, "):
        paged_decode_attention(q, kc, vc, tables[:1], lens_t)
    with pytest.raises(ValueError, match=r"context_lens.*\(3,\)"):
        paged_decode_attention(q, kc, vc, tables, torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, kc, vc, tables.float(), lens_t)
    with pytest.raises(ValueError, match=r"k_cache"):
        paged_decode_attention(q, kc[..., :16], vc[..., :16], tables, lens_t)


def test_store_kv_roundtrip_and_bad_shapes():
    kc = torch.zeros(4, 8, 2, 32, device=DEV)
    vc = torch.zeros_like(kc)
    k, v = torch.randn(5, 2, 32, device=DEV), torch.randn(5, 2, 32, device=DEV)
    slots = torch.tensor([0, 9, 31, 17, 8], device=DEV)
    store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 32)[slots], k) and torch.equal(vc.view(-1, 2, 32)[slots], v)
    assert kc.view(-1, 2, 32)[1].abs().sum() == 0
    with pytest.raises(ValueError, match=r"\(5, 1, 32\)"):
        store_kv(k[:, :1], v[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match=r"slot_mapping"):
        store_kv(k, v, kc, vc, slots[:4])


# ------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["triton", "sdpa", "cudnn", "flash_attn"])
@pytest.mark.parametrize("sq,sk", [(4096, 4096), (1000, 4096)])
def test_gpu_attention_bf16_realistic(backend, causal, sq, sk):
    if backend == "flash_attn" and not _dispatch.has_flash_attn():
        pytest.skip("flash_attn not installed")
    kernels = resolve_kernels(DEV, backend=backend)
    chosen = _dispatch.attention_backend(kernels.attention, torch.bfloat16, causal, sq, sk, 128)
    if backend == "cudnn" and not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        pytest.skip("this torch has no cuDNN attention op")
    if backend in ("sdpa", "cudnn") and causal and sq != sk:
        assert chosen == "triton"  # top-left causal would be wrong here
    else:
        assert chosen == backend
    q, k, v = _qkv(sq, sk, 32, 8, 128, torch.bfloat16, seed=1)
    ref = flash_attn_with_lse_reference(q, k, v, causal=causal)
    _check_attn(flash_attn_with_lse(q, k, v, causal=causal, kernels=kernels), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", [(777, 1500), (1500, 777), (1, 3000)])
def test_gpu_triton_attention_head_dims(d, sq, sk):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        q, k, v = _qkv(sq, sk, 8, 2, d, dtype, seed=d)
        ref = flash_attn_with_lse_reference(q, k, v, causal=True)
        _check_attn(flash_attn_with_lse(q, k, v, causal=True), ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[32768], [0, 1, 5000, 17, 70000, 4096, 333, 12345]])
def test_gpu_paged_decode_bf16_realistic(lens):
    q, kc, vc, tables, lens_t, ks, vs = _paged_case(lens, 32, 8, 128, 16, torch.bfloat16)
    o, lse = paged_decode_attention(q, kc, vc, tables, lens_t, max_context_len=max(lens))
    _check_attn((o, lse), paged_decode_attention_reference(q, kc, vc, tables, lens_t),
                torch.bfloat16)


@pytest.mark.gpu
def test_gpu_merge_bf16():
    o1, l1, o2, l2 = _partials(300, 32, 128, torch.bfloat16)
    o, lse = merge_attention_outputs(o1, l1, o2, l2)
    ro, rlse = merge_attention_outputs_reference(o1, l1, o2, l2)
    assert not o.isnan().any() and _rel_err(o, ro) < 1e-2
    _check_lse(lse, rlse, atol=1e-5)
    assert math.isfinite(lse[0, -1].item())


@pytest.mark.gpu
def test_gpu_paged_decode_cuda_graph():
    # With max_context_len given there is no host sync: the call can be captured in a CUDA
    # graph and replayed after context_lens / q change in place.
    lens = [3000, 700]
    q, kc, vc, tables, lens_t, _, _ = _paged_case(lens, 16, 4, 128, 16, torch.bfloat16)
    paged_decode_attention(q, kc, vc, tables, lens_t, max_context_len=4096)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = paged_decode_attention(q, kc, vc, tables, lens_t, max_context_len=4096)
    for new_lens in ([3000, 700], [2999, 1], [0, 650]):
        lens_t.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = paged_decode_attention_reference(q, kc, vc, tables, lens_t)
        _check_attn((o.clone(), lse.clone()), ref, torch.bfloat16)
