"""Prefill attention over fp8 K/V blocks (sparsekv/kernels/fp8_attention.py): the Triton kernel dequantizes on load
and must equal attention over the explicitly dequantized K/V (the pure-torch reference), causal or not, with GQA and
the log-sum-exp; bad scales or a block size the key tiles cannot align to are refused. Off-GPU the kernel runs
under the Triton interpreter in float32 (the interpreter's tl.dot takes bf16 operands as raw bits); bf16 at real
size runs on a GPU."""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import flash_attn_with_lse_reference
from sparsekv.kernels.backend import KernelChoice
from sparsekv.kernels.fp8_attention import (dequantize_kv, flash_attn_fp8_with_lse,
                                            flash_attn_fp8_with_lse_reference)
from sparsekv.kernels.fp8_kv import FP8_DTYPE, quantize_block
from tests.kernels.test_kernels import DEV, _check_attn


def _fp8_ring(nb: int, bs: int, kvh: int, d: int, seed: int, first: int = 1):
    """fp8 K and V of nb blocks as a ring group reads them: [nb * bs, KVH, D] views of slots [first, first + nb) of
    a larger slot tensor, with their [nb, KVH] scale views. Each (block, head) has its own magnitude, so a scale
    applied to the wrong block or head shows."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.zeros(2, nb + 2, bs, kvh, d, dtype=FP8_DTYPE)
    slot_scales = torch.zeros(2, nb + 2, kvh)
    for kv in range(2):
        x = torch.randn(nb, bs, kvh, d, generator=g) * (torch.rand(nb, 1, kvh, 1, generator=g) * 8 + 0.1)
        for b in range(nb):
            quantize_block(x[b], slots[kv, first + b], slot_scales[kv, first + b])
    slots, slot_scales = slots.to(DEV), slot_scales.to(DEV)
    k, v = (slots[kv, first:first + nb].flatten(0, 1) for kv in range(2))
    return k, v, (slot_scales[0, first:first + nb], slot_scales[1, first:first + nb])


def _want(q, k, v, scales, causal, scale=None):
    """Attention over the dequantized K/V, in the reference's fp32."""
    kd, vd = (dequantize_kv(x, s, q.dtype) for x, s in zip((k, v), scales))
    return flash_attn_with_lse_reference(q, kd, vd, scale, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,nb,bs", [(33, 3, 16), (40, 2, 32), (50, 1, 32), (5, 3, 16)])
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_matches_dequantize_then_attend(triton_kernels, causal, sq, nb, bs, group):
    """Sq > Sk (causal rows that see no key), Sq < Sk, and a few rows (the split kernel's path)."""
    kvh, d = 2, 32
    k, v, scales = _fp8_ring(nb, bs, kvh, d, seed=sq * 100 + nb * bs + group)
    q = torch.randn(sq, kvh * group, d, generator=torch.Generator().manual_seed(sq)).to(DEV)
    want = _want(q, k, v, scales, causal)
    _check_attn(flash_attn_fp8_with_lse(q, k, v, scales, causal=causal, kernels=triton_kernels), want, q.dtype)
    reference = flash_attn_fp8_with_lse_reference(q, k, v, scales, causal=causal)
    _check_attn(reference, want, q.dtype)
    torch_path = flash_attn_fp8_with_lse(q, k, v, scales, causal=causal, kernels=KernelChoice.torch_reference())
    _check_attn(torch_path, want, q.dtype)


def test_scales_are_not_ignored(triton_kernels):
    """Doubling one block's V scale changes the output exactly as doubling its dequantized values does."""
    k, v, (ks, vs) = _fp8_ring(3, 16, 2, 32, seed=7)
    q = torch.randn(20, 4, 32, generator=torch.Generator().manual_seed(3)).to(DEV)
    vs2 = vs.clone()
    vs2[1] *= 2
    ks2 = ks.clone()
    ks2[2, 0] *= 3
    got = flash_attn_fp8_with_lse(q, k, v, (ks2, vs2), kernels=triton_kernels)
    want = _want(q, k, v, (ks2, vs2), causal=False)
    _check_attn(got, want, q.dtype)
    assert (want[0] - _want(q, k, v, (ks, vs), causal=False)[0]).norm() > 0.1 * want[0].norm()


def test_softmax_scale_and_empty_inputs(triton_kernels):
    k, v, scales = _fp8_ring(2, 16, 2, 32, seed=11)
    q = torch.randn(24, 2, 32, generator=torch.Generator().manual_seed(5)).to(DEV)
    got = flash_attn_fp8_with_lse(q, k, v, scales, softmax_scale=0.05, kernels=triton_kernels)
    _check_attn(got, _want(q, k, v, scales, causal=False, scale=0.05), q.dtype)
    o, lse = flash_attn_fp8_with_lse(q[:0], k, v, scales, kernels=triton_kernels)
    assert o.shape == (0, 2, 32) and lse.shape == (2, 0)


def test_bad_inputs_are_refused(triton_kernels):
    k, v, (ks, vs) = _fp8_ring(2, 16, 2, 32, seed=1)
    q = torch.randn(20, 4, 32, device=DEV)
    with pytest.raises(ValueError, match="nb dividing"):
        flash_attn_fp8_with_lse(q, k, v, (ks[:, :1], vs[:, :1]), kernels=triton_kernels)
    with pytest.raises(ValueError, match="nb dividing"):
        flash_attn_fp8_with_lse(q, k[:25], v[:25], (ks, vs), kernels=triton_kernels)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        flash_attn_fp8_with_lse(q, k.float(), v.float(), (ks, vs), kernels=triton_kernels)
    with pytest.raises(ValueError, match="H a multiple of KVH"):
        flash_attn_fp8_with_lse(q[:, :3], k, v, (ks, vs), kernels=triton_kernels)
    # blocks of 8 keys: no key tile of >= 16 lies inside one block
    k8, v8, scales8 = _fp8_ring(4, 8, 2, 32, seed=2)
    with pytest.raises(ValueError, match="block size 8 must be a multiple of 16"):
        flash_attn_fp8_with_lse(q, k8, v8, scales8, kernels=triton_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bs,nb,sq", [(256, 12, 1024), (1024, 4, 2048)])
def test_gpu_real_size(causal, bs, nb, sq):
    """bf16 at a model's size (head dim 128, 32 query heads over 8 KV heads, a few thousand keys in blocks of 256
    and 1024), compiled, against the dequantize-then-attend reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sparsekv.kernels.backend import resolve_kernels

    kernels = resolve_kernels("cuda", backend="triton")
    k, v, scales = _fp8_ring(nb, bs, 8, 128, seed=bs + sq)
    q = torch.randn(sq, 32, 128, generator=torch.Generator().manual_seed(sq)).to(DEV, torch.bfloat16)
    got = flash_attn_fp8_with_lse(q, k, v, scales, causal=causal, kernels=kernels)
    torch.cuda.synchronize()
    _check_attn(got, _want(q, k, v, scales, causal), q.dtype)
