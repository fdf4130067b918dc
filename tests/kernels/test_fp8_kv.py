"""fp8 KV blocks (sparsekv/kernels/fp8_kv.py): per-(block, KV head) quantization round trip, the dequantize kernel
against its reference, and the decode split kernel's dequantize-on-load against the reference path, which
dequantizes explicitly. Triton kernels run under the interpreter off-GPU (the `triton_kernels` fixture)."""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import flash_attn_with_lse_reference
from sparsekv.kernels.backend import KernelChoice
from sparsekv.kernels.decode_attention import DecodePartials
from sparsekv.kernels.fp8_kv import (FP8_DTYPE, FP8_MAX, dequantize_blocks, dequantize_blocks_reference, quantize_block,
                                    quantize_kv_block)
from tests.kernels.test_kernels import DEV, _check_attn

# e4m3 keeps 3 mantissa bits: round to nearest is within half an ulp, 2^-4 of the value, for normal values; values
# below the smallest normal (2^-6 of the head's amax / 448 scale) are off by at most half the subnormal step 2^-10
REL = 2.0 ** -4
SUBNORMAL_HALF_STEP = 2.0 ** -10


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[1], dtype=torch.float32, device=x.device)
    quantize_block(x, out, scale)
    return out, scale


def _within_fp8(x: torch.Tensor, x8: torch.Tensor, scale: torch.Tensor) -> None:
    back = x8.float() * scale[None, :, None]
    bound = REL * x.float().abs() + SUBNORMAL_HALF_STEP * scale[None, :, None] + 1e-30
    assert torch.all((back - x.float()).abs() <= bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_per_block_and_head(dtype):
    """Each head of a block gets its own scale (amax / 448): a head 1000x larger than its neighbours does not
    flatten them, and every value comes back within fp8's rounding of itself."""
    torch.manual_seed(0)
    x = torch.randn(64, 4, 32, device=DEV).to(dtype)
    x[:, 1] *= 1000.0  # a large-magnitude head
    x[:, 3] *= 1e-3
    x8, scale = _quantize(x)
    amax = x.float().abs().amax(dim=(0, 2))
    torch.testing.assert_close(scale, amax / FP8_MAX)
    assert x8.float().abs().amax(dim=(0, 2)).eq(FP8_MAX).all()  # each head uses the whole fp8 range
    _within_fp8(x, x8, scale)


def test_all_zero_block_and_head_stay_zero():
    x = torch.zeros(16, 2, 32, device=DEV)
    x8, scale = _quantize(x)
    assert scale.eq(0).all() and x8.float().eq(0).all()
    y = torch.randn(16, 2, 32, device=DEV)
    y[:, 0] = 0
    y8, y_scale = _quantize(y)
    assert y_scale[0] == 0 and not torch.isnan(y8.float()).any()
    _within_fp8(y, y8, y_scale)


def test_partial_block_writes_its_rows_only():
    x = torch.randn(5, 2, 32, device=DEV)
    out = torch.zeros(16, 2, 32, dtype=FP8_DTYPE, device=DEV)
    scale = torch.empty(2, device=DEV)
    quantize_block(x, out, scale)
    _within_fp8(x, out[:5], scale)
    assert out[5:].float().eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 20, 64])
def test_quantize_kernel_matches_reference(triton_kernels, n, dtype):
    """K and V of one block in one launch, from strided views of a wider buffer (the prefill buffer's rows): the
    same scales as the reference, the same fp8 values up to a tie rounded the other way (one fp8 step: 2^-3 of the
    value, or a subnormal step), and an all-zero head stays zero."""
    torch.manual_seed(n)
    buffer = torch.randn(2, 80, 3, 32, device=DEV).to(dtype)
    buffer[1, :, 2] *= 500.0
    buffer[0, :, 1] = 0
    k, v = buffer[0, 5:5 + n], buffer[1, 5:5 + n]  # [n, KVH, D] views
    out = torch.empty(2, n, 3, 32, dtype=FP8_DTYPE, device=DEV)
    scales = torch.full((2, 3), float("nan"), device=DEV)
    quantize_kv_block(k, v, out, scales, kernels=triton_kernels)
    want_out = torch.empty_like(out)
    want_scales = torch.empty_like(scales)
    quantize_kv_block(k, v, want_out, want_scales, kernels=KernelChoice.torch_reference())
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    assert scales[0, 1] == 0 and out[0, :, 1].float().eq(0).all()
    got, want = out.float(), want_out.float()
    assert torch.all((got - want).abs() <= 2 ** -3 * want.abs() + 2 ** -9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 16, 2, 32), (1, 8, 4, 64)])
def test_dequantize_kernel_matches_reference(triton_kernels, shape, dtype):
    torch.manual_seed(sum(shape))
    nb, bs, kvh, d = shape
    x8 = (torch.randn(shape, device=DEV) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scales = torch.rand(nb, kvh, device=DEV) * 10
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    want = torch.empty(shape, dtype=dtype, device=DEV)
    dequantize_blocks(x8, scales, out, kernels=triton_kernels)
    dequantize_blocks_reference(x8, scales, want)
    # exact in float32; bf16 output: the interpreter rounds toward zero, the reference to nearest (one bf16 ulp)
    tol = {} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 0}
    torch.testing.assert_close(out, want, **({"rtol": 0, "atol": 0} if not tol else tol))


def test_dequantize_rejects_bad_scales():
    x8 = torch.zeros(2, 4, 2, 8, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="scales"):
        dequantize_blocks(x8, torch.zeros(2, 3), torch.empty(2, 4, 2, 8), kernels=KernelChoice.torch_reference())


def _fp8_blocks(nb: int, bs: int, kvh: int, d: int, seed: int):
    """fp8 K and V of nb blocks [nb * bs, KVH, D] with their [nb, KVH] scales, and the values they stand for."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(nb, bs, kvh, d, generator=g) * torch.rand(nb, 1, kvh, 1, generator=g) * 5 for _ in range(2))
    out = []
    for x in (k, v):
        x8 = torch.empty(x.shape, dtype=FP8_DTYPE)
        scales = torch.empty(nb, kvh)
        for b in range(nb):
            quantize_block(x[b], x8[b], scales[b])
        out.append((x8.flatten(0, 1).to(DEV), scales.to(DEV)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("nb,bs,splits", [(1, 64, 1), (3, 16, 4), (4, 48, 3)])
def test_decode_kernel_dequantizes_on_load(triton_kernels, nb, bs, splits, dtype):
    """DecodePartials.add(k8, v8, scales=...) (the split kernel reading fp8 and scales) equals attention over the
    explicitly dequantized K/V, merged with a model-dtype key set as in a decode step (ring groups, then the tail).
    bf16 runs on a GPU only (the interpreter's tl.dot takes bf16 operands as raw bits)."""
    h, kvh, d = 8, 2, 32
    (k8, ks), (v8, vs) = _fp8_blocks(nb, bs, kvh, d, seed=nb * bs)
    q = torch.randn(1, h, d, device=DEV).to(dtype)
    tail_k, tail_v = torch.randn(2, 5, kvh, d, device=DEV).to(dtype)
    scale = d ** -0.5
    partials = DecodePartials(q, scale, max_sets=2, splits_per_set=splits, kernels=triton_kernels)
    partials.add(k8, v8, scales=(ks, vs))
    partials.add(tail_k, tail_v)
    k = (k8.float().unflatten(0, (nb, bs)) * ks[:, None, :, None]).flatten(0, 1)
    v = (v8.float().unflatten(0, (nb, bs)) * vs[:, None, :, None]).flatten(0, 1)
    want = flash_attn_with_lse_reference(q, torch.cat([k.to(dtype), tail_k]), torch.cat([v.to(dtype), tail_v]), scale)
    _check_attn(partials.finish(), want, dtype)
    reference = DecodePartials(q, scale, max_sets=2, kernels=KernelChoice.torch_reference())
    reference.add(k8, v8, scales=(ks, vs))
    reference.add(tail_k, tail_v)
    _check_attn(reference.finish(), want, dtype)


def test_decode_scales_are_checked():
    q = torch.randn(1, 4, 32)
    k8 = torch.zeros(32, 2, 32, dtype=FP8_DTYPE)
    partials = DecodePartials(q, 1.0, max_sets=1, kernels=KernelChoice.torch_reference())
    with pytest.raises(ValueError, match="nb dividing"):
        partials.add(k8, k8, scales=(torch.ones(3, 2), torch.ones(3, 2)))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        partials.add(k8.float(), k8.float(), scales=(torch.ones(2, 2), torch.ones(2, 2)))
