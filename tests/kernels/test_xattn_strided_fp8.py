"""fp8 copies of q and k for XAttention's estimate (sparsekv/policies/xattn/strided_fp8.py): one scale per
(strided row, head), the kernel against its reference, and the round trip. Triton kernels run under the interpreter
off-GPU (the `triton_kernels` fixture poisons their outputs)."""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels.fp8_kv import FP8_DTYPE, FP8_MAX
from sparsekv.policies.xattn.strided_fp8 import (dequantize_strided, quantize_strided, quantize_strided_reference,
                                                 strided_rows)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.usefixtures("triton_kernels", "one_thread")


def _row_amax(x: torch.Tensor, stride: int, first: int) -> torch.Tensor:
    """[rows, H] amax of each strided row's tokens, by a plain loop over positions."""
    rows = strided_rows(x.shape[0], stride, first)
    amax = torch.zeros(rows, x.shape[1], device=x.device)
    for i in range(x.shape[0]):
        r = (first + i) // stride - first // stride
        amax[r] = torch.maximum(amax[r], x[i].float().abs().amax(dim=-1))
    return amax


@pytest.mark.parametrize("m,heads,dim,stride,first,dtype", [
    (64, 2, 32, 8, 0, torch.float32),      # whole strides from position 0 (k)
    (37, 3, 16, 4, 5, torch.float32),      # starts and ends inside a strided row (a chunk of q)
    (10, 1, 24, 2, 3, torch.float16),      # head dim not a power of two
    (129, 4, 128, 8, 1024, torch.bfloat16),  # Qwen3's head dim, a block-aligned chunk with a ragged end
    (3, 2, 16, 8, 6, torch.float32),       # fewer tokens than one stride, across a row boundary
])
def test_quantize_strided_kernel_matches_reference(m, heads, dim, stride, first, dtype):
    gen = torch.Generator().manual_seed(m + first)
    x = (torch.randn(m, heads, dim, generator=gen) * 3).to(DEV, dtype)
    x[: min(m, 2), 0] = 0  # zero tokens share a row with real ones
    x8, scale = quantize_strided(x, stride, first)
    want8, want_scale = quantize_strided_reference(x, stride, first)
    rows = strided_rows(m, stride, first)
    assert x8.shape == x.shape and x8.dtype == FP8_DTYPE and scale.shape == (rows, heads)
    torch.testing.assert_close(scale, _row_amax(x, stride, first) / FP8_MAX, rtol=1e-6, atol=0)
    torch.testing.assert_close(want_scale, scale, rtol=1e-6, atol=0)
    got, want = x8.float(), want8.float()
    assert torch.all((got - want).abs() <= 2 ** -3 * want.abs() + 2 ** -9)  # at most a tie rounded the other way
    back = dequantize_strided(x8, scale, stride, first)  # [m, H, D] fp32
    row_scale = scale[(torch.arange(m, device=DEV) + first % stride) // stride][:, :, None]
    assert torch.all((back - x.float()).abs() <= 2 ** -4 * x.float().abs() + 2 ** -10 * row_scale)


def test_quantize_strided_rows_have_their_own_scales():
    """A strided row 1000x larger than its neighbours does not flatten them; each row reaches fp8's largest value;
    a row of zeros gets scale 0 and zeros."""
    x = torch.randn(32, 2, 16, device=DEV)
    x[8:16] *= 1000.0  # strided row 1 at stride 8
    x[16:24, 1] = 0.0  # row 2 of head 1
    x8, scale = quantize_strided(x, 8, 0)
    assert scale[2, 1] == 0 and x8[16:24, 1].float().eq(0).all()
    assert scale[1].min() > 100 * scale[0].max()
    amax8 = x8.float().view(4, 8, 2, 16).abs().amax(dim=(1, 3))  # [rows, H]
    assert torch.equal(amax8 == FP8_MAX, scale > 0)


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.randn(4, 16)), r"x \[m, H, D\]"),
    (dict(x=torch.ones(4, 2, 16, dtype=torch.int32)), "floating"),
    (dict(stride=0), "stride=0"),
    (dict(first=-1), "first=-1"),
    (dict(stride=True), "stride=True"),
])
def test_quantize_strided_bad_inputs_raise(bad, match):
    args = dict(x=torch.randn(4, 2, 16), stride=4, first=0) | bad
    with pytest.raises(ValueError, match=match):
        quantize_strided(**args)


@pytest.mark.gpu
def test_gpu_quantize_strided_realistic():
    """The k of a 64K prompt and an 8K chunk of q at Qwen3-4B's shape."""
    gen = torch.Generator().manual_seed(0)
    for m, heads, first in ((65536, 8, 0), (8192, 32, 57344)):
        x = torch.randn(m, heads, 128, generator=gen).to(DEV, torch.bfloat16)
        x8, scale = quantize_strided(x, 8, first)
        want8, want_scale = quantize_strided_reference(x, 8, first)
        torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
        got, want = x8.float(), want8.float()
        assert torch.all((got - want).abs() <= 2 ** -3 * want.abs() + 2 ** -9)
