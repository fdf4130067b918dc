"""The dense prefill kernel's variants (attention.PrefillVariant) against the reference on fresh random inputs.

'dense' is _flash_fwd_kernel (2-D grid, or heavy_first's 1-D grid); 'ws' is flash_prefill_ws's single-loop kernel
(warp-specialized when compiled for Hopper, a plain loop under the interpreter), also in its persistent form (3
programs under the interpreter, so that each walks several tiles). Every variant must keep the
kernel's contract: bottom-right causal alignment with Sq != Sk either way, GQA, rows that see no key (o = 0,
lse = -inf), sizes off the block grid, fp32 inputs on the exact-dot path, and a 'ws' call it cannot run (no TMA
view, non-positive scale) falling back to 'dense'.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsekv.kernels import attention, flash_attn_with_lse_reference

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter runs 'ws' in fp32; compiled, it is Hopper's and 16-bit only (elsewhere 'ws' falls back to 'dense').
DTYPE = torch.float32 if DEV.type == "cpu" else torch.bfloat16
WS_RUNS = DEV.type == "cpu" or torch.cuda.get_device_capability()[0] == 9

VARIANTS = {
    "dense-heavy-first": attention.PrefillVariant("dense", heavy_first=True),
    "ws-2d-grid": attention.PrefillVariant("ws", heavy_first=False),
    "ws-heavy-first": attention.PrefillVariant("ws", heavy_first=True),
    "ws-persistent": attention.PrefillVariant("ws", persistent=True),
}
# (Sq, Sk): square off the block grid, Sq < Sk (bottom-right diagonal), Sq > Sk (leading rows see no key).
SHAPES = [(37, 37), (20, 70), (50, 19)]


def _qkv(sq, sk, h, kvh, d, dtype=DTYPE, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(sq, h, d), mk(sk, kvh, d), mk(sk, kvh, d)


def _run(q, k, v, causal, variant, scale=None):
    Sq, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o = torch.full((Sq, H, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((H, Sq), float("nan"), dtype=torch.float32, device=q.device)
    ran = attention.launch_prefill(q, k, v, o, lse, scale, causal, variant)
    return (o, lse), ran


def _expected(variant) -> str:
    return "ws" if variant.kernel == "ws" and WS_RUNS else "dense"


def _check(out, ref):
    o, lse = out
    ro, rlse = ref
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    tol = 1e-2 if o.dtype != torch.float32 else (3e-3 if DEV.type == "cuda" else 1e-4)
    no_key = torch.isneginf(rlse).all(0)  # [Sq] rows that see no key
    if no_key.any():
        assert o[no_key].abs().max().item() == 0.0
    err = ((o.float() - ro.float()).norm() / ro.float().norm()).item()
    assert err < tol, err
    finite = torch.isfinite(rlse)
    assert (lse[finite] - rlse[finite]).abs().max().item() < 20 * tol


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_variant_matches_reference(name, causal, sq, sk):
    q, k, v = _qkv(sq, sk, 4, 2, 32, seed=sq * 1000 + sk * 10 + causal)
    out, ran = _run(q, k, v, causal, VARIANTS[name])
    assert ran == _expected(VARIANTS[name])
    _check(out, flash_attn_with_lse_reference(q, k, v, causal=causal))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_gqa_groups(name):
    for group in (1, 4):
        q, k, v = _qkv(45, 61, 4, 4 // group, 16, seed=group)
        _check(_run(q, k, v, True, VARIANTS[name])[0], flash_attn_with_lse_reference(q, k, v, causal=True))


def test_ws_causal_offset_sweep():
    # Every alignment of the diagonal against the key blocks: the single loop masks each block by position only.
    bn = attention.INTERPRET_CONFIG[1] if attention.INTERPRET else attention.WS_CONFIG[1]
    for off in range(-5, bn + 5, 4):
        q, k, v = _qkv(2 * bn + 3, 2 * bn + 3 + off, 2, 1, 32, seed=50 + off)
        out, ran = _run(q, k, v, True, VARIANTS["ws-heavy-first"])
        assert ran == _expected(VARIANTS["ws-heavy-first"])
        _check(out, flash_attn_with_lse_reference(q, k, v, causal=True))


def test_ws_falls_back_where_it_cannot_run():
    q, k, v = _qkv(33, 40, 4, 2, 32, seed=3)
    ref = flash_attn_with_lse_reference(q, k, v, softmax_scale=-0.4, causal=True)
    out, ran = _run(q, k, v, True, VARIANTS["ws-heavy-first"], scale=-0.4)  # the fused exp2 scale needs scale > 0
    assert ran == "dense"
    _check(out, ref)
    wide = torch.zeros(40, 2, 64, device=DEV, dtype=DTYPE)
    wide[..., :32] = k
    k_strided = wide[..., :32]  # heads 2 * D apart: no TMA view
    out, ran = _run(q, k_strided, v, False, VARIANTS["ws-heavy-first"])
    assert ran == "dense"
    _check(out, flash_attn_with_lse_reference(q, k, v, causal=False))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bf16_variants(name, causal):
    q, k, v = _qkv(1000, 2048, 32, 8, 128, torch.bfloat16, seed=1)
    _check(_run(q, k, v, causal, VARIANTS[name])[0], flash_attn_with_lse_reference(q, k, v, causal=causal))
