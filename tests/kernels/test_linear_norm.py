"""kernels/linear_norm.py: a linear layer's split-K reduction, the residual add and the next RMSNorm in one launch.

Under the interpreter (conftest's triton_kernels) the fused launch must equal the separate ops it replaces
(skinny_linear / silu_mul_linear, then add_rms_norm) bit for bit, and the pure-torch reference within rounding,
for one and several splits, with and without bias, gated and not, at one and several rows.
"""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import gemv as G
from sparsekv.kernels import gemv_configs as GC
from sparsekv.kernels import linear_norm as LN
from sparsekv.kernels.linear_norm import linear_add_rms_norm, linear_add_rms_norm_reference
from sparsekv.kernels.rmsnorm import add_rms_norm
from sparsekv.layers.linear import Linear
from sparsekv.layers.norm import RMSNorm
from tests.conftest import CountLaunches

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.usefixtures("triton_kernels", "one_thread")


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int, gated: bool, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, (2 if gated else 1) * k, generator=g) * 2).to(DEV, dtype)  # [M, K] or gate_up [M, 2K]
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, dtype)  # [N, K]
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None  # [N]
    residual = torch.randn(m, n, generator=g).to(DEV, dtype)  # [M, N]
    norm_w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV, dtype)  # [N]
    return x, w, b, residual, norm_w


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
@pytest.mark.parametrize("m,bias", [(1, False), (1, True), (3, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_equals_separate_ops(split, gated, m, bias, dtype, monkeypatch):
    """K = 100 and N = 50 are ragged against the 16-wide tiles; SHAPE_CONFIGS' row fixes the split count."""
    monkeypatch.setattr(GC, "SHAPE_CONFIGS", ((50, 100, False, 16, 16, 4, 1, split),))
    monkeypatch.setattr(GC, "CONFIGS", ((G.MAX_M, False, 16, 16, 4, 1),))
    monkeypatch.setattr(GC, "MAX_SPLIT_K", split)
    monkeypatch.setattr(GC, "MIN_PROGRAM_BYTES", 16)
    x, w, b, residual, norm_w = _inputs(m, 100, 50, dtype, seed=7 * m + split, gated=gated, bias=bias)
    reduce = CountLaunches(LN._reduce_add_rms_norm_kernel)
    monkeypatch.setattr(LN, "_reduce_add_rms_norm_kernel", reduce)
    normed, new_residual = linear_add_rms_norm(x, w, b, residual, norm_w, 1e-6, gated=gated)
    assert reduce.calls == 1
    assert G.choose_config(m, 50, 100, x.element_size(), DEV).split_k == split
    want_normed, want_residual = LN._separate(x, w, b, residual, norm_w, 1e-6, gated)
    assert not normed.isnan().any() and not new_residual.isnan().any()
    assert torch.equal(new_residual, want_residual) and torch.equal(normed, want_normed)
    ref_normed, ref_residual = linear_add_rms_norm_reference(x, w, b, residual, norm_w, 1e-6, gated)
    # bf16: a 1-ulp difference of the rounded linear output (summation order) moves the sum by up to ~0.04
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (8e-2, 2e-2)
    torch.testing.assert_close(new_residual.float(), ref_residual.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(normed.float(), ref_normed.float(), atol=atol, rtol=rtol)


def test_falls_back_to_separate_ops_beyond_the_kernel(monkeypatch):
    """More rows than MAX_M (a prefill): F.linear then add_rms_norm, no fused launch; the same values."""
    reduce = CountLaunches(LN._reduce_add_rms_norm_kernel)
    monkeypatch.setattr(LN, "_reduce_add_rms_norm_kernel", reduce)
    x, w, b, residual, norm_w = _inputs(G.MAX_M + 1, 32, 24, torch.float32, seed=3, gated=False, bias=True)
    normed, new_residual = linear_add_rms_norm(x, w, b, residual, norm_w, 1e-6)
    want = add_rms_norm(torch.nn.functional.linear(x, w, b), residual, norm_w, 1e-6)
    assert reduce.calls == 0
    assert torch.equal(normed, want[0]) and torch.equal(new_residual, want[1])


def test_bad_inputs_name_the_shapes():
    x, w, b, residual, norm_w = _inputs(2, 32, 24, torch.float32, seed=4, gated=False, bias=False)
    with pytest.raises(ValueError, match=r"residual \(2, 23\) must be \[M=2, N=24\]"):
        linear_add_rms_norm(x, w, b, residual[:, :23], norm_w, 1e-6)
    with pytest.raises(ValueError, match="residual is torch.float64"):
        linear_add_rms_norm(x, w, b, residual.double(), norm_w, 1e-6)
    with pytest.raises(ValueError, match=r"weight \[N\]"):
        linear_add_rms_norm(x, w, b, residual, norm_w[:10], 1e-6)
    with pytest.raises(ValueError, match="K=32"):
        linear_add_rms_norm(x[:, :30], w, b, residual, norm_w, 1e-6)


def test_linear_add_norm_forward_follows_its_kernel_choice(triton_kernels, monkeypatch):
    """Linear.add_norm_forward: the fused launch where the skinny GEMV runs, else norm(self(x), residual)."""
    import dataclasses

    from sparsekv.kernels import KernelChoice

    torch.manual_seed(0)
    weight, bias, norm_w = torch.randn(24, 32, device=DEV), torch.randn(24, device=DEV), torch.randn(24, device=DEV)
    x, residual = torch.randn(1, 32, device=DEV), torch.randn(1, 24, device=DEV)
    reduce = CountLaunches(LN._reduce_add_rms_norm_kernel)
    monkeypatch.setattr(LN, "_reduce_add_rms_norm_kernel", reduce)
    gemv = dataclasses.replace(triton_kernels, gemv_max_rows=G.MAX_M)
    for kernels, launches in ((gemv, 1), (dataclasses.replace(gemv, gemv_max_rows=0), 1),
                              (KernelChoice.torch_reference(), 1)):
        layer = Linear(32, 24, bias=True, kernels=kernels).to(DEV)
        norm = RMSNorm(24, kernels=kernels).to(DEV)
        layer.weight.data.copy_(weight)
        layer.bias.data.copy_(bias)
        norm.weight.data.copy_(norm_w)
        normed, new_residual = layer.add_norm_forward(x, residual, norm)
        want = norm(layer(x), residual)
        torch.testing.assert_close(normed, want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new_residual, want[1], atol=1e-5, rtol=1e-5)
        assert reduce.calls == launches


@pytest.mark.gpu
@pytest.mark.parametrize("k,gated", [(4096, False), (9728, True)], ids=["o_proj", "down"])
def test_qwen3_4b_shapes_on_gpu(k, gated):
    """The decode step's o and down projections of Qwen3-4B (N = 2560, the tuned SHAPE_CONFIGS rows: split 2 and a
    split-K heuristic): the fused launch equals the separate ops bit for bit, and the reference within bf16 rounding."""
    x, w, _, residual, norm_w = _inputs(1, k, 2560, torch.bfloat16, seed=k, gated=gated, bias=False)
    normed, new_residual = linear_add_rms_norm(x, w, None, residual, norm_w, 1e-6, gated=gated)
    want_normed, want_residual = LN._separate(x, w, None, residual, norm_w, 1e-6, gated)
    assert torch.equal(new_residual, want_residual) and torch.equal(normed, want_normed)
    ref_normed, ref_residual = linear_add_rms_norm_reference(x, w, None, residual, norm_w, 1e-6, gated)
    torch.testing.assert_close(new_residual.float(), ref_residual.float(), atol=8e-2, rtol=2e-2)
    torch.testing.assert_close(normed.float(), ref_normed.float(), atol=8e-2, rtol=2e-2)
