"""XAttention's fused block-mass estimate, the block-sparse attention kernel, and XAttentionPolicy.compute_prefill
(offload=none) through them.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by conftest; the `triton_kernels`
fixture asks for them and poisons every output buffer). The interpreter mishandles bf16 tl.dot, so CPU tests use
fp32 and fp16; bf16 at realistic sizes is in the GPU-marked tests at the end.
"""
from __future__ import annotations

import math

import pytest
import torch

from sparsekv.policies.xattn import block_select as select_module
from sparsekv.policies.xattn import block_sparse_attention as bsa_module
from sparsekv.kernels import flash_attn_with_lse_reference
from sparsekv.policies.xattn import xattn_estimate as estimate_module
from sparsekv.policies.xattn.block_sparse_attention import (
    block_lists_from_mask,
    block_sparse_attention,
    block_sparse_attention_reference,
)
from sparsekv.policies.xattn.xattn_estimate import xattn_block_mass, xattn_block_mass_reference
from sparsekv.policies.xattn import XAttentionPolicy
from tests.conftest import CountLaunches, compiled_variants, host_sync_sites

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32_TOL = 3e-3 if DEV.type == "cuda" else 1e-5  # fp32 tl.dot is tf32 on the GPU

pytestmark = pytest.mark.usefixtures("triton_kernels", "one_thread")


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(DEV, dtype)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _layout(n: int, seq: int, bs: int, q_start: int | None = None) -> tuple[int, int, int]:
    """(qb0, nqb, nkb) of queries at q_start (default: the last n positions)."""
    q_start = seq - n if q_start is None else q_start
    qb0 = q_start // bs
    return qb0, -(-(q_start + n) // bs) - qb0, -(-seq // bs)


def _masked_attention(q, k, v, allowed, scale):
    """fp32 attention with an explicit [n, S] mask, GQA by repetition -> (o [n, H, D], lse [H, n])."""
    group = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    s = s.masked_fill(~allowed.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("hqk,khd->qhd", p, vf), lse


def _kept_pairs(keep: torch.Tensor, qb0: int, q_start: int, n: int, seq: int, bs: int) -> torch.Tensor:
    """[n, S] (query, key) pairs of each query block's kept key blocks, causal."""
    pos = torch.arange(q_start, q_start + n, device=keep.device)[:, None]
    key = torch.arange(seq, device=keep.device)[None, :]
    return (key <= pos) & keep[pos // bs - qb0, key // bs]


def _check_attention(out, ref, dtype):
    o, lse = out
    ro, rlse = ref
    assert o.shape == ro.shape and o.dtype == ro.dtype and lse.shape == rlse.shape and lse.dtype == torch.float32
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    finite = torch.isfinite(rlse)
    tol = F32_TOL if dtype == torch.float32 else 2e-3
    if finite.any():
        assert (lse[finite] - rlse[finite]).abs().max().item() < 10 * tol
    assert (o.float() - ro.float()).abs().max().item() < 10 * tol and _rel_err(o, ro) < tol


# ------------------------------------------------------------------------------------------- block-mass estimate
@pytest.mark.parametrize("seq,n,h,kvh,d,stride,bs,dtype", [
    (64, 64, 2, 2, 16, 4, 16, torch.float32),     # self-attention prefill, MHA
    (203, 77, 4, 1, 32, 4, 16, torch.float32),    # GQA 4; q_start = 126 neither block- nor stride-aligned; S ragged
    (150, 61, 4, 2, 24, 2, 16, torch.float16),    # fp16, head dim not a power of two
    (300, 130, 2, 1, 16, 8, 64, torch.float32),   # 8 strided columns per 64-token block
    (97, 3, 2, 1, 16, 1, 32, torch.float32),      # stride 1: a block (32 columns) is wider than the column tile
    (70, 1, 2, 2, 16, 4, 16, torch.float32),      # a single query
])
@pytest.mark.parametrize("fp8", [False, True], ids=["exact", "fp8"])
def test_block_mass_kernel_matches_reference(seq, n, h, kvh, d, stride, bs, dtype, fp8, monkeypatch):
    """The kernels against the reference, on q and k as given or (fp8) on their fp8 copies, which the reference
    quantizes and dequantizes the same way."""
    gen = torch.Generator().manual_seed(seq * 7 + n)
    q, k = _randn(n, h, d, gen=gen, dtype=dtype), _randn(seq, kvh, d, gen=gen, dtype=dtype)
    launches = CountLaunches(estimate_module._block_lse_kernel)
    monkeypatch.setattr(estimate_module, "_block_lse_kernel", launches)
    mass = xattn_block_mass(q, k, stride, bs, fp8=fp8)
    ref = xattn_block_mass_reference(q, k, stride, bs, fp8=fp8)
    _, nqb, nkb = _layout(n, seq, bs)
    assert launches.calls == 1 and mass.shape == ref.shape == (kvh, nqb, nkb) and mass.dtype == torch.float32
    assert not mass.isnan().any()
    # fp8: a tie the kernel's quantization rounds the other way moves one value by one fp8 step; tensor cores
    # accumulate fp8 products in ~22 bits
    tol = 3e-3 if fp8 else F32_TOL
    assert (mass - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
    # each valid strided row's softmax sums to one: the mass of a query block totals group * (valid rows)
    q_start = seq - n
    rows = torch.arange((q_start // bs) * bs // stride, nkb * bs // stride, device=DEV)
    valid = ((rows + 1) * stride > q_start) & (rows * stride < seq)
    per_block = valid.view(nqb, bs // stride).sum(1).float() * (h // kvh)
    assert torch.allclose(mass.sum(-1), per_block.expand(kvh, -1), atol=1e-3)


def test_block_mass_kernel_is_the_antidiagonal_definition():
    """The kernel against the definition, loop by loop (fp64), on a chunk after an unaligned prefix."""
    gen = torch.Generator().manual_seed(4)
    kv_heads, heads, dim, bs, stride = 2, 4, 16, 16, 4
    seq, n = 3 * bs + 7, 2 * bs + 1
    q, k = torch.randn(n, heads, dim, generator=gen), torch.randn(seq, kv_heads, dim, generator=gen)
    q_start, nkb = seq - n, -(-seq // bs)
    qb0 = q_start // bs
    expected = torch.zeros(kv_heads, nkb - qb0, nkb, dtype=torch.float64)
    qd, kd = q.double(), k.double()
    for h in range(heads):
        for i in range(qb0 * bs // stride, nkb * bs // stride):
            if not any(q_start <= i * stride + t < seq for t in range(stride)):
                continue
            scores = torch.zeros(i + 1, dtype=torch.float64)
            for j in range(i + 1):
                for t in range(stride):
                    qi, kj = i * stride + stride - 1 - t, j * stride + t
                    if q_start <= qi < seq and kj < seq:
                        scores[j] += qd[qi - q_start, h] @ kd[kj, h // (heads // kv_heads)]
            p = torch.softmax(scores / dim ** 0.5 / stride, dim=0)
            for j in range(i + 1):
                expected[h // (heads // kv_heads), i * stride // bs - qb0, j * stride // bs] += p[j]
    mass = xattn_block_mass(q.to(DEV), k.to(DEV), stride, bs).cpu().double()
    assert torch.allclose(mass, expected, atol=F32_TOL)


@pytest.mark.parametrize("seq,n,expect_tma", [
    (256, 128, True),   # a chunk on block boundaries, whole strides: TMA descriptors of the strided views
    (256, 256, True),   # the whole prompt
    (250, 122, False),  # a prompt ending off the stride grid: pointer loads
    (256, 120, False),  # a chunk starting inside a block: pointer loads
])
def test_block_mass_strided_tma_views_match_pointer_loads(seq, n, expect_tma, monkeypatch):
    """Where the layout allows, the estimate reads q and k through TMA descriptors of their [S / stride, stride *
    row] views; elsewhere through pointers. Both compute the reference's mass."""
    if not estimate_module.tma_device_ok(DEV):
        pytest.skip("no TMA descriptors on this device")
    gen = torch.Generator().manual_seed(seq + n)
    q, k = _randn(n, 4, 16, gen=gen), _randn(seq, 2, 16, gen=gen)
    taken = []
    real = estimate_module.use_strided_tma
    monkeypatch.setattr(estimate_module, "use_strided_tma", lambda *a: taken.append(real(*a)) or taken[-1])
    mass = xattn_block_mass(q, k, 4, 32)
    assert taken == [expect_tma]
    assert (mass - xattn_block_mass_reference(q, k, 4, 32)).abs().max().item() < F32_TOL
    monkeypatch.setattr(estimate_module, "use_strided_tma", lambda *a: False)
    assert (mass - xattn_block_mass(q, k, 4, 32)).abs().max().item() < F32_TOL


def test_block_mass_kernel_in_slices(monkeypatch):
    """Long chunks run in slices of whole query blocks (the [H, rows, nkb] scratch stays bounded)."""
    gen = torch.Generator().manual_seed(9)
    block_m = estimate_module._config(_randn(1, 1, 16, gen=gen), 4, False)[0]  # the row tile this device launches
    n = 150 * max(1, block_m // 16)  # enough strided rows for three slices of one row tile
    q, k = _randn(n, 4, 16, gen=gen), _randn(n + 80, 2, 16, gen=gen)
    nkb = -(-(n + 80) // 16)
    monkeypatch.setattr(estimate_module, "LSB_ELEMENTS", 4 * nkb * block_m)  # one row tile of 4 heads x nkb blocks
    launches = CountLaunches(estimate_module._mass_kernel)
    monkeypatch.setattr(estimate_module, "_mass_kernel", launches)
    mass = xattn_block_mass(q, k, 4, 16)
    rows = -(-n // 16) * 4  # query blocks of 16 keys, 4 strided rows each
    assert launches.calls == -(-rows // block_m) >= 3
    assert (mass - xattn_block_mass_reference(q, k, 4, 16)).abs().max().item() < F32_TOL


def test_block_mass_kernel_splits_columns_among_programs(monkeypatch):
    """A row tile's column tiles are split among several programs (each a flat pipelined loop over its share) when
    the launch would otherwise have few programs; every split writes only its own key blocks."""
    gen = torch.Generator().manual_seed(13)
    q, k = _randn(200, 4, 16, gen=gen), _randn(1000, 2, 16, gen=gen)
    monkeypatch.setattr(estimate_module, "PROGRAMS", 1 << 20)
    monkeypatch.setattr(estimate_module, "MIN_SPLIT_TILES", 1)
    launches = CountLaunches(estimate_module._block_lse_kernel)
    monkeypatch.setattr(estimate_module, "_block_lse_kernel", launches)
    mass = xattn_block_mass(q, k, 4, 16)
    assert launches.calls == 1 and launches.grids[0][2] > 1
    assert (mass - xattn_block_mass_reference(q, k, 4, 16)).abs().max().item() < F32_TOL


@pytest.mark.gpu
def test_block_mass_kernels_compile_once_for_the_chunks_of_a_prompt(monkeypatch):
    """Chunks differ in their lengths, offsets and tiles per split (here 2, 4 and 1; Triton would specialise 1 and
    multiples of 16): one compiled estimate kernel and one mass kernel serve them all, so no chunk compiles in the
    middle of a prefill."""
    gen = torch.Generator().manual_seed(17)
    q_all, k = _randn(4096, 8, 128, gen=gen, dtype=torch.bfloat16), _randn(4096, 2, 128, gen=gen, dtype=torch.bfloat16)
    kernels = (estimate_module._block_lse_kernel, estimate_module._mass_kernel)
    xattn_block_mass(q_all[1024:2048], k[:2048], 8, 128)  # compiles (or loads) both
    before = [compiled_variants(kernel) for kernel in kernels]
    xattn_block_mass(q_all[3096:4096], k, 8, 128)  # 1,000 queries after 3,096 keys
    monkeypatch.setattr(estimate_module, "PROGRAMS", 1 << 20)
    monkeypatch.setattr(estimate_module, "MIN_SPLIT_TILES", 1)  # one column tile per program
    mass = xattn_block_mass(q_all[2048:], k, 8, 128)
    assert [compiled_variants(kernel) for kernel in kernels] == before
    assert torch.isfinite(mass).any()


def test_block_mass_unsupported_block_layout_runs_the_reference(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    q, k = _randn(50, 2, 16, gen=gen), _randn(100, 1, 16, gen=gen)
    launches = CountLaunches(estimate_module._block_lse_kernel)
    monkeypatch.setattr(estimate_module, "_block_lse_kernel", launches)
    mass = xattn_block_mass(q, k, 4, 24)  # 6 strided columns per block: not a power of two
    assert launches.calls == 0 and torch.equal(mass, xattn_block_mass_reference(q, k, 4, 24))


def test_block_mass_bad_inputs_raise():
    q, k = torch.randn(8, 4, 16), torch.randn(16, 2, 16)
    with pytest.raises(ValueError, match="multiple of stride"):
        xattn_block_mass(q, k, 3, 16)
    with pytest.raises(ValueError, match="stride=0"):
        xattn_block_mass(q, k, 0, 16)
    with pytest.raises(ValueError, match="n=8 must be <= S=4"):
        xattn_block_mass(q, k[:4], 4, 16)
    with pytest.raises(ValueError, match="multiple of k heads"):
        xattn_block_mass(q, torch.randn(16, 3, 16), 4, 16)
    with pytest.raises(ValueError, match="dtype"):
        xattn_block_mass(q, k.half(), 4, 16)
    with pytest.raises(ValueError, match=r"q \[n, H, D\]"):
        xattn_block_mass(q[0], k, 4, 16)


# ------------------------------------------------------------------------------------------- block-sparse attention
def _random_keep(nqb: int, nkb: int, qb0: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """[nqb, nkb] random causal selection with the diagonal block always kept."""
    qb = torch.arange(qb0, qb0 + nqb)[:, None]
    kb = torch.arange(nkb)[None, :]
    keep = (torch.rand(nqb, nkb, generator=gen) < density) & (kb <= qb)
    return (keep | (kb == qb)).to(DEV)


@pytest.mark.parametrize("seq,n,h,kvh,d,bs,q_start,dtype,density", [
    (96, 96, 2, 2, 16, 16, None, torch.float32, 0.5),     # self-attention prefill, MHA
    (203, 77, 4, 1, 32, 16, None, torch.float32, 0.4),    # GQA 4, unaligned q_start, a partial last block
    (150, 61, 4, 2, 24, 32, None, torch.float16, 0.5),    # fp16, head dim not a power of two
    (300, 130, 2, 1, 16, 48, 100, torch.float32, 0.5),    # queries in the middle (later keys invisible), bs 48
    (64, 5, 2, 1, 16, 64, None, torch.float32, 1.0),      # one query block
    (100, 40, 2, 1, 16, 24, None, torch.float32, 0.5),    # bs 24 has no power-of-two divisor >= 16: reference
])
def test_block_sparse_kernel_matches_reference(seq, n, h, kvh, d, bs, q_start, dtype, density):
    gen = torch.Generator().manual_seed(seq + n + bs)
    q = _randn(n, h, d, gen=gen, dtype=dtype)
    k, v = _randn(seq, kvh, d, gen=gen, dtype=dtype), _randn(seq, kvh, d, gen=gen, dtype=dtype)
    qs = seq - n if q_start is None else q_start
    qb0, nqb, nkb = _layout(n, seq, bs, qs)
    keep = _random_keep(nqb, nkb, qb0, density, gen)
    idx, count = block_lists_from_mask(keep)
    assert idx.dtype == count.dtype == torch.int32 and count.tolist() == keep.sum(1).tolist()
    scale = 0.7 / math.sqrt(d)
    ref = block_sparse_attention_reference(q, k, v, idx, count, bs, scale, q_start)
    _check_attention(block_sparse_attention(q, k, v, idx, count, bs, scale, q_start), ref, dtype)
    # the reference itself against the definition
    _check_attention(ref, tuple(x.to(dtype) if x.dim() == 3 else x for x in _masked_attention(
        q, k, v, _kept_pairs(keep, qb0, qs, n, seq, bs), scale)), dtype)


@pytest.mark.parametrize("fused_scale,use_tma", [(False, False), (True, False), (False, True)])
def test_block_sparse_kernel_tile_variants(fused_scale, use_tma, monkeypatch):
    """The dense kernel's per-tile variants (the default, both on, runs in the tests above)."""
    monkeypatch.setattr(bsa_module, "VARIANTS", {"FUSED_SCALE": fused_scale, "USE_TMA": use_tma})
    gen = torch.Generator().manual_seed(13)
    seq, n, bs, q_start = 230, 90, 32, 101  # queries in the middle, unaligned
    q, k, v = _randn(n, 4, 32, gen=gen), _randn(seq, 2, 32, gen=gen), _randn(seq, 2, 32, gen=gen)
    qb0, nqb, nkb = _layout(n, seq, bs, q_start)
    idx, count = block_lists_from_mask(_random_keep(nqb, nkb, qb0, 0.5, gen))
    ref = block_sparse_attention_reference(q, k, v, idx, count, bs, 0.3, q_start)
    _check_attention(block_sparse_attention(q, k, v, idx, count, bs, 0.3, q_start), ref, torch.float32)


def test_block_sparse_kernel_with_every_block_is_dense_attention():
    gen = torch.Generator().manual_seed(11)
    seq, n, bs = 150, 70, 16
    q, k, v = _randn(n, 4, 32, gen=gen), _randn(seq, 2, 32, gen=gen), _randn(seq, 2, 32, gen=gen)
    qb0, nqb, nkb = _layout(n, seq, bs)
    keep = torch.arange(nkb, device=DEV)[None, :] <= torch.arange(qb0, qb0 + nqb, device=DEV)[:, None]
    idx, count = block_lists_from_mask(keep)
    dense = flash_attn_with_lse_reference(q, k, v, 0.3, causal=True)
    _check_attention(block_sparse_attention(q, k, v, idx, count, bs, 0.3), dense, torch.float32)


def test_block_sparse_kernel_empty_rows_and_blocks_after_the_diagonal():
    """A query block with no listed block gives o = 0, lse = -inf; listed blocks after the query block (allowed by
    the contract) contribute nothing; entries past the count are never read."""
    gen = torch.Generator().manual_seed(12)
    seq, n, bs = 80, 50, 16  # q_start 30: query blocks 1..4
    q, k, v = _randn(n, 2, 16, gen=gen), _randn(seq, 1, 16, gen=gen), _randn(seq, 1, 16, gen=gen)
    pad = 99999
    idx = torch.tensor([[0, 3, 4, pad], [pad, pad, pad, pad], [0, 1, 3, pad], [2, 4, pad, pad]],
                       dtype=torch.int32, device=DEV)
    count = torch.tensor([3, 0, 3, 2], dtype=torch.int32, device=DEV)
    out = block_sparse_attention(q, k, v, idx, count, bs, 0.25)
    ref = block_sparse_attention_reference(q, k, v, idx, count, bs, 0.25)
    _check_attention(out, ref, torch.float32)
    rows_qb2 = slice(2 * bs - 30, 3 * bs - 30)
    assert torch.isneginf(out[1][:, rows_qb2]).all() and (out[0][rows_qb2] == 0).all()
    # query block 1 lists 0, 3, 4 (3 and 4 lie after it; its own block 1 is not listed): it attends to block 0 only
    keep = torch.zeros(4, 5, dtype=torch.bool, device=DEV)
    keep[0, 0], keep[2, [0, 1, 3]], keep[3, [2, 4]] = True, True, True
    expected = _masked_attention(q, k, v, _kept_pairs(keep, 1, 30, n, seq, bs), 0.25)
    _check_attention(out, (expected[0].to(q.dtype), expected[1]), torch.float32)


def test_block_sparse_bad_inputs_raise():
    q, k = torch.randn(20, 4, 16), torch.randn(40, 2, 16)
    idx, count = torch.zeros((2, 3), dtype=torch.int32), torch.ones(2, dtype=torch.int32)  # 40 - 20 = 20: blocks 1, 2
    with pytest.raises(ValueError, match="block_idx of shape"):
        block_sparse_attention(q, k, k, idx[:1], count, 16)
    with pytest.raises(ValueError, match="block_count of shape"):
        block_sparse_attention(q, k, k, idx, count[:1], 16)
    with pytest.raises(ValueError, match="block_idx must hold integers"):
        block_sparse_attention(q, k, k, idx.float(), count, 16)
    with pytest.raises(ValueError, match="q_start=25"):
        block_sparse_attention(q, k, k, idx, count, 16, q_start=25)
    with pytest.raises(ValueError, match="block_size=0"):
        block_sparse_attention(q, k, k, idx, count, 0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        block_sparse_attention(q, torch.randn(40, 3, 16), torch.randn(40, 3, 16), idx, count, 16)
    with pytest.raises(ValueError, match="bool tensor"):
        block_lists_from_mask(torch.ones(2, 3))


# ------------------------------------------------------------------------------------------- policy (offload=none)
def _planted(seq: int, heads: int = 4, kv_heads: int = 2, dim: int = 16, bs: int = 16, seed: int = 2):
    """Random keys plus a needle block 3 aligned with every query: a sparse selection that keeps it."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(dim, generator=gen), dim=0)
    k = 0.3 * torch.randn(seq, kv_heads, dim, generator=gen)
    k[3 * bs:4 * bs] += 4.0 * u
    v = torch.randn(seq, kv_heads, dim, generator=gen)
    q = 4.0 * u + 0.3 * torch.randn(seq, heads, dim, generator=gen)
    return q.to(DEV), k.to(DEV), v.to(DEV)


@pytest.mark.parametrize("n_back", [0, 3 * 16 + 7])
def test_policy_compute_prefill_is_the_masked_attention_of_its_selection(n_back, monkeypatch):
    bs, seq = 16, 12 * 16 + 5
    q_all, k, v = _planted(seq)
    n = seq - n_back  # the whole prompt, then a chunk after an unaligned prefix
    q = q_all[seq - n:]
    policy = XAttentionPolicy(threshold=0.6, stride=4, block_size=bs)
    launches = CountLaunches(bsa_module._bsa_fwd_kernel)
    monkeypatch.setattr(bsa_module, "_bsa_fwd_kernel", launches)
    selection = [CountLaunches(getattr(select_module, name)) for name in ("_threshold_kernel", "_runs_kernel")]
    for counter, name in zip(selection, ("_threshold_kernel", "_runs_kernel")):
        monkeypatch.setattr(select_module, name, counter)
    out = policy.compute_prefill(q, k, v, 0, 0.25)
    assert launches.calls == 1  # one launch for every query block: no grouping, no gathering
    assert [counter.calls for counter in selection] == [1, 1]  # the selection: threshold, then lists and runs
    keep, qb0 = policy.select_prefill_blocks(q, k)
    visible = sum(qb + 1 for qb in range(qb0, keep.shape[1]))
    assert policy.last_density == pytest.approx(keep.sum().item() / visible) and policy.last_density < 0.8
    assert keep[:, 0].all() and keep[torch.arange(keep.shape[0]), torch.arange(qb0, keep.shape[1])].all()
    expected, _ = _masked_attention(q, k, v, _kept_pairs(keep, qb0, seq - n, n, seq, bs), 0.25)
    assert _rel_err(out, expected) < F32_TOL and (out - expected).abs().max().item() < 10 * F32_TOL


def test_policy_keeping_every_block_is_dense_attention(monkeypatch):
    bs, seq, n = 16, 9 * 16 + 3, 70
    q_all, k, v = _planted(seq, seed=3)
    q = q_all[seq - n:]
    dense, _ = flash_attn_with_lse_reference(q, k, v, 0.25, causal=True)
    out = XAttentionPolicy(threshold=1.0, stride=4, block_size=bs).compute_prefill(q, k, v, 0, 0.25)
    assert _rel_err(out, dense) < F32_TOL  # threshold 1.0: the dense shortcut
    policy = XAttentionPolicy(threshold=0.5, stride=4, block_size=bs)
    monkeypatch.setattr(policy, "select_prefill_runs",
                        lambda q, k: XAttentionPolicy(threshold=1.0, block_size=bs).select_prefill_runs(q, k))
    out = policy.compute_prefill(q, k, v, 0, 0.25)  # every visible block through the block-sparse kernel
    assert _rel_err(out, dense) < F32_TOL and policy.last_density == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
def test_gpu_block_mass_bf16_realistic():
    """bf16 at Qwen3-4B's shape: the 16-bit kernel against the reference, the fp8 one (the default here) against the
    reference of the fp8 copies, and fp8 against exact within the estimate's needs."""
    gen = torch.Generator().manual_seed(0)
    seq, n, h, kvh, d = 16384, 4096, 32, 8, 128
    q, k = _randn(n, h, d, gen=gen, dtype=torch.bfloat16), _randn(seq, kvh, d, gen=gen, dtype=torch.bfloat16)
    assert estimate_module.fp8_estimate_ok(q) == (torch.cuda.get_device_capability() >= (8, 9))
    exact = xattn_block_mass_reference(q, k, 8, 128)
    mass = xattn_block_mass(q, k, 8, 128, fp8=False)
    assert not mass.isnan().any() and (mass - exact).abs().max().item() < 1e-3 * exact.abs().max().item()
    if estimate_module.fp8_estimate_ok(q):
        mass8 = xattn_block_mass(q, k, 8, 128)
        ref8 = xattn_block_mass_reference(q, k, 8, 128, fp8=True)
        assert not mass8.isnan().any() and (mass8 - ref8).abs().max().item() < 1e-3 * ref8.abs().max().item()
        assert _rel_err(mass8, exact) < 5e-3


@pytest.mark.gpu
def test_gpu_block_sparse_bf16_realistic():
    gen = torch.Generator().manual_seed(1)
    seq, n, h, kvh, d, bs = 16384, 4096, 32, 8, 128, 128
    q = _randn(n, h, d, gen=gen, dtype=torch.bfloat16)
    k, v = _randn(seq, kvh, d, gen=gen, dtype=torch.bfloat16), _randn(seq, kvh, d, gen=gen, dtype=torch.bfloat16)
    qb0, nqb, nkb = _layout(n, seq, bs)
    keep = _random_keep(nqb, nkb, qb0, 0.3, gen)
    keep[:, 0] = True
    idx, count = block_lists_from_mask(keep)
    o, lse = block_sparse_attention(q, k, v, idx, count, bs, d ** -0.5)
    ro, rlse = block_sparse_attention_reference(q, k, v, idx, count, bs, d ** -0.5)
    assert not o.isnan().any() and _rel_err(o, ro) < 1e-2 and (lse - rlse).abs().max().item() < 1e-2


@pytest.mark.gpu
def test_gpu_compute_prefill_does_not_sync():
    gen = torch.Generator().manual_seed(2)
    seq, n = 16384 + 77, 4096
    q = _randn(n, 32, 128, gen=gen, dtype=torch.bfloat16)
    k, v = _randn(seq, 8, 128, gen=gen, dtype=torch.bfloat16), _randn(seq, 8, 128, gen=gen, dtype=torch.bfloat16)
    policy = XAttentionPolicy(threshold=0.9)
    policy.compute_prefill(q, k, v, 0, 128 ** -0.5)  # compile first
    assert host_sync_sites(lambda: policy.compute_prefill(q, k, v, 0, 128 ** -0.5)) == []
    assert 0.0 < policy.last_density <= 1.0


@pytest.mark.gpu
def test_gpu_compute_prefill_launches_a_handful_of_kernels(monkeypatch):
    """fp8 copies of q and k, estimate, mass, threshold, runs, the kept count and the attention: the selection is two
    kernels, not the ~60 small torch ops whose gaps left the GPU idle once per layer and chunk."""
    from torch.profiler import ProfilerActivity, profile

    from sparsekv.kernels import _dispatch

    gen = torch.Generator().manual_seed(3)
    seq, n = 16384, 4096
    q = _randn(n, 32, 128, gen=gen, dtype=torch.bfloat16)
    k, v = _randn(seq, 8, 128, gen=gen, dtype=torch.bfloat16), _randn(seq, 8, 128, gen=gen, dtype=torch.bfloat16)
    monkeypatch.setattr(_dispatch, "POISON_OUTPUTS", False)  # no NaN fills of the outputs: only the kernels
    policy = XAttentionPolicy(threshold=0.7)
    policy.compute_prefill(q, k, v, 0, 128 ** -0.5)  # compile first
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        policy.compute_prefill(q, k, v, 0, 128 ** -0.5)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    assert 4 <= len(kernels) <= 10, [name[:40] for name in kernels]
