"""The dense prefill attention kernel (attention._flash_fwd_kernel) on each of its code paths against the reference.

The kernel moves q/k/v/o through TMA descriptors where the layouts allow (sm_90+, or the interpreter) and plain
pointer loads elsewhere; it folds the scale into exp2 for a positive scale and scales the scores first otherwise.
On CPU it runs under the Triton interpreter (fp32: see tests/kernels/test_kernels.py), on CUDA compiled (bf16 too).
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsekv.kernels import attention, flash_attn_with_lse, flash_attn_with_lse_reference
from tests.conftest import growing_row_maxima

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TMA_DEVICE = DEV.type != "cuda" or torch.cuda.get_device_capability()[0] >= 9


def _qkv(sq, sk, h, kvh, d, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(sq, h, d), mk(sk, kvh, d), mk(sk, kvh, d)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t [S, heads, D] as a view whose heads are 2 * D apart: no TMA [S, heads * D] view exists."""
    wide = torch.zeros(t.shape[0], t.shape[1], 2 * t.shape[2], dtype=t.dtype, device=t.device)
    wide[..., :t.shape[2]] = t
    return wide[..., :t.shape[2]]


def _config(dtype: torch.dtype, d: int, block_m: int | None = None, block_n: int | None = None):
    if attention.INTERPRET:
        cfg = attention.INTERPRET_CONFIG
    else:
        cfg = (attention.GPU_CONFIGS_FP32 if dtype == torch.float32 else attention.GPU_CONFIGS)[d]
    return (block_m or cfg[0], block_n or cfg[1], cfg[2], cfg[3])


def _run(q, k, v, causal, config=None, scale=None):
    """Launch _flash_fwd_kernel directly (bypassing the small-Sq decode path) into NaN-poisoned outputs."""
    Sq, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o = torch.full((Sq, H, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((H, Sq), float("nan"), dtype=torch.float32, device=q.device)
    attention._launch_flash_fwd(q, k, v, o, lse, scale, causal, config or _config(q.dtype, D))
    return o, lse


def _check(out, ref, dtype) -> None:
    o, lse = out
    ro, rlse = ref
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    tol = 1e-2 if dtype != torch.float32 else (3e-3 if DEV.type == "cuda" else 1e-4)
    if ro.float().norm() > 0:
        err = ((o.float() - ro.float()).norm() / ro.float().norm()).item()
        assert err < tol, err
    else:
        assert o.float().abs().max().item() == 0.0
    finite = torch.isfinite(rlse)
    if finite.any():
        assert (lse[finite] - rlse[finite]).abs().max().item() < 20 * tol


def _layout(q, k, v, path: str):
    if path == "pointers":
        q, k, v = _strided(q), _strided(k), _strided(v)
        assert not attention.use_tma(q, k, v, torch.empty_like(q))
    elif TMA_DEVICE:
        assert attention.use_tma(q, k, v, torch.empty_like(q))
    return q, k, v


PATHS = ["tma", "pointers"]
# (Sq, Sk): square, Sq < Sk (bottom-right diagonal), Sq > Sk (empty leading rows), sizes off the block grid.
SHAPES = [(33, 33), (20, 50), (50, 19), (48, 48)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_matches_reference(path, causal, sq, sk):
    q, k, v = _qkv(sq, sk, 4, 2, 32, seed=sq * 100 + sk)
    ref = flash_attn_with_lse_reference(q, k, v, causal=causal)
    _check(_run(*_layout(q, k, v, path), causal), ref, q.dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale", [0.3, -0.5])  # a non-positive scale takes the unfused-scale code
@pytest.mark.parametrize("group", [1, 4])
def test_gqa_groups_and_scale(path, scale, group):
    q, k, v = _qkv(37, 37, 4, 4 // group, 16, seed=group)
    ref = flash_attn_with_lse_reference(q, k, v, softmax_scale=scale, causal=True)
    _check(_run(*_layout(q, k, v, path), True, scale=scale), ref, q.dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
def test_rows_whose_max_grows_along_the_keys(path, causal):
    # the online softmax rescales the accumulator as rows' maxima grow from block to block; a non-positive scale
    # takes the unfused step
    q, k, v = _qkv(40, 72, 4, 2, 32, seed=11)
    q, k = growing_row_maxima(q, k, 6.0)
    for scale in (None, -0.3):
        ref = flash_attn_with_lse_reference(q, k, v, softmax_scale=scale, causal=causal)
        _check(_run(*_layout(q, k, v, path), causal, scale=scale), ref, q.dtype)


@pytest.mark.parametrize("path", PATHS)
def test_causal_offset_sweep(path):
    # Every alignment of the diagonal against the key blocks, with block shapes BLOCK_M != BLOCK_N both ways.
    bm, bn = _config(torch.float32, 32)[:2]
    for off in range(-3, bn + 3, 3):
        q, k, v = _qkv(2 * bm + 2, 2 * bm + 2 + off, 2, 1, 32, seed=100 + off)
        ref = flash_attn_with_lse_reference(q, k, v, causal=True)
        for config in (None, _config(q.dtype, 32, block_m=2 * bm, block_n=bn),
                       _config(q.dtype, 32, block_m=bm, block_n=2 * bn)):
            _check(_run(*_layout(q, k, v, path), True, config), ref, q.dtype)


def test_packed_qkv_strides_keep_tma():
    # q, k, v sliced out of one packed projection: strided rows, heads * D contiguous, so TMA views still work.
    h, kvh, d, s = 4, 2, 32, 37
    qkv = torch.randn(s, h + 2 * kvh, d, device=DEV)
    q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
    if TMA_DEVICE:
        assert attention.use_tma(q, k, v, torch.empty_like(q))
    ref = flash_attn_with_lse_reference(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    _check(_run(q, k, v, True), ref, q.dtype)


def test_public_api_runs_the_kernel(triton_kernels):
    q, k, v = _qkv(40, 40, 4, 2, 32, seed=9)
    for causal in (False, True):
        _check(flash_attn_with_lse(q, k, v, causal=causal, kernels=triton_kernels),
               flash_attn_with_lse_reference(q, k, v, causal=causal), q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bf16(path, causal):
    q, k, v = _qkv(1000, 2048, 32, 8, 128, torch.bfloat16, seed=1)
    ref = flash_attn_with_lse_reference(q, k, v, causal=causal)
    _check(_run(*_layout(q, k, v, path), causal), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_head_dims_and_dtypes(d, dtype):
    q, k, v = _qkv(777, 1500, 8, 2, d, dtype, seed=d)
    _check(_run(q, k, v, True), flash_attn_with_lse_reference(q, k, v, causal=True), dtype)
