"""Every compile-time variant of the prefill attention kernel (attention.ATTN_VARIANTS) against the reference.

On CPU the kernel runs under the Triton interpreter (fp32: see tests/test_kernels.py), on CUDA compiled (bf16 too).
Each variant the tuning script (scripts/tune_attention.py) may pick is checked here, alone and combined, so that
turning one on in ATTN_VARIANTS is known to be correct.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsekv.kernels import attention, flash_attn_with_lse, flash_attn_with_lse_reference

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.usefixtures("triton_kernels")

SINGLE = [{name: True} for name in attention.ATTN_VARIANTS]
COMBOS = [
    {"REVERSE_M": True, "HEADS_OUTER": True},
    {"USE_TMA": True, "FUSED_SCALE": True},
    {name: True for name in attention.ATTN_VARIANTS},
]
VARIANTS = SINGLE + COMBOS


def _vid(variants: dict) -> str:
    return "+".join(sorted(variants)) or "default"


def _qkv(sq, sk, h, kvh, d, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(sq, h, d), mk(sk, kvh, d), mk(sk, kvh, d)


def _config(dtype: torch.dtype, d: int, block_m: int | None = None, block_n: int | None = None):
    if attention.triton_interpret():
        cfg = attention.INTERPRET_CONFIG
    else:
        cfg = (attention.GPU_CONFIGS_FP32 if dtype == torch.float32 else attention.GPU_CONFIGS)[d]
    return (block_m or cfg[0], block_n or cfg[1], cfg[2], cfg[3])


def _run(q, k, v, causal, variants, config=None, scale=None):
    """Launch _flash_fwd_kernel directly (bypassing the small-Sq decode path) into NaN-poisoned outputs."""
    Sq, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o = torch.full((Sq, H, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((H, Sq), float("nan"), dtype=torch.float32, device=q.device)
    attention._launch_flash_fwd(q, k, v, o, lse, scale, causal, config or _config(q.dtype, D), variants)
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


def _assert_flags_on(q, k, v, variants, scale=None):
    """The variant really runs (is not dropped for these tensors), except where the installed Triton lacks it."""
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    o = torch.empty_like(q)
    flags = attention.effective_attn_variants(q, k, v, o, scale, variants)
    for name in variants:
        if name == "WARP_SPECIALIZE" and not attention.HAS_WARP_SPECIALIZE:
            continue
        if name == "USE_TMA" and DEV.type == "cuda" and torch.cuda.get_device_capability()[0] < 9:
            continue
        assert flags[name], (name, flags)


# (Sq, Sk): square, Sq < Sk (bottom-right diagonal), Sq > Sk (empty leading rows), sizes off the block grid.
SHAPES = [(33, 33), (20, 50), (50, 19), (48, 48)]


@pytest.mark.parametrize("variants", VARIANTS, ids=_vid)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_variant_matches_reference(variants, causal, sq, sk):
    q, k, v = _qkv(sq, sk, 4, 2, 32, seed=sq * 100 + sk)
    _assert_flags_on(q, k, v, variants)
    _check(_run(q, k, v, causal, variants), flash_attn_with_lse_reference(q, k, v, causal=causal), q.dtype)


@pytest.mark.parametrize("variants", VARIANTS, ids=_vid)
@pytest.mark.parametrize("group", [1, 4])
def test_variant_gqa_groups_and_scale(variants, group):
    q, k, v = _qkv(37, 37, 4, 4 // group, 16, seed=group)
    ref = flash_attn_with_lse_reference(q, k, v, softmax_scale=0.3, causal=True)
    _check(_run(q, k, v, True, variants, scale=0.3), ref, q.dtype)


@pytest.mark.parametrize("variants", VARIANTS, ids=_vid)
def test_variant_causal_offset_sweep(variants):
    # Every alignment of the diagonal against the key blocks, with block shapes BLOCK_M != BLOCK_N both ways.
    bm, bn = _config(torch.float32, 32)[:2]
    for off in range(-3, bn + 3, 3):
        q, k, v = _qkv(2 * bm + 2, 2 * bm + 2 + off, 2, 1, 32, seed=100 + off)
        ref = flash_attn_with_lse_reference(q, k, v, causal=True)
        for config in (None, _config(q.dtype, 32, block_m=2 * bm, block_n=bn),
                       _config(q.dtype, 32, block_m=bm, block_n=2 * bn)):
            _check(_run(q, k, v, True, variants, config), ref, q.dtype)


@pytest.mark.parametrize("variants", VARIANTS, ids=_vid)
def test_variant_packed_qkv_strides(variants):
    # q, k, v sliced out of one packed projection: strided rows (TMA views keep working: heads * D contiguous).
    h, kvh, d, s = 4, 2, 32, 37
    qkv = torch.randn(s, h + 2 * kvh, d, device=DEV)
    q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
    _assert_flags_on(q, k, v, variants)
    ref = flash_attn_with_lse_reference(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    _check(_run(q, k, v, True, variants), ref, q.dtype)


def test_tma_falls_back_for_non_tma_layouts():
    # k/v whose head dim is strided across heads cannot be a [S, KVH * D] TMA view: the default loads run instead.
    q, _, _ = _qkv(33, 33, 4, 2, 32, seed=5)
    kv = torch.randn(33, 2, 2 * 32, device=DEV)
    k, v = kv[:, :, :32], kv[:, :, 32:]
    flags = attention.effective_attn_variants(q, k, v, torch.empty_like(q), 0.2, {"USE_TMA": True})
    assert not flags["USE_TMA"]
    ref = flash_attn_with_lse_reference(q, k.contiguous(), v.contiguous(), causal=True)
    _check(_run(q, k, v, True, {"USE_TMA": True}), ref, q.dtype)


def test_fused_scale_falls_back_for_non_positive_scale():
    q, k, v = _qkv(33, 33, 4, 2, 32, seed=6)
    assert not attention.effective_attn_variants(q, k, v, q, -0.5, {"FUSED_SCALE": True})["FUSED_SCALE"]
    ref = flash_attn_with_lse_reference(q, k, v, softmax_scale=-0.5, causal=True)
    _check(_run(q, k, v, True, {"FUSED_SCALE": True}, scale=-0.5), ref, q.dtype)


def test_unknown_variant_raises():
    q, k, v = _qkv(33, 33, 4, 2, 32)
    with pytest.raises(ValueError, match="NOT_A_FLAG"):
        attention.effective_attn_variants(q, k, v, q, 0.2, {"NOT_A_FLAG": True})


def test_default_variants_are_the_tuned_winners():
    """The defaults are what scripts/tune_attention.py picked on an H100; WARP_SPECIALIZE failed its D=64 GPU tests."""
    on = {name for name, flag in attention.ATTN_VARIANTS.items() if flag}
    assert on == {"FUSED_SCALE", "USE_TMA"}


@pytest.mark.parametrize("variants", [COMBOS[-1]], ids=_vid)
def test_enabled_in_module_dict_reaches_public_api(variants, monkeypatch):
    # The lead turns a winner on by editing ATTN_VARIANTS: flash_attn_with_lse must then run it, correctly.
    for name, on in variants.items():
        monkeypatch.setitem(attention.ATTN_VARIANTS, name, on)
    q, k, v = _qkv(40, 40, 4, 2, 32, seed=9)
    for causal in (False, True):
        _check(flash_attn_with_lse(q, k, v, causal=causal), flash_attn_with_lse_reference(q, k, v, causal=causal),
               q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("variants", VARIANTS, ids=_vid)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_variant_bf16(variants, causal):
    q, k, v = _qkv(1000, 2048, 32, 8, 128, torch.bfloat16, seed=1)
    _assert_flags_on(q, k, v, variants)
    _check(_run(q, k, v, causal, variants), flash_attn_with_lse_reference(q, k, v, causal=causal), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("variants", SINGLE + COMBOS[-1:], ids=_vid)
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_variant_head_dims_and_dtypes(variants, d, dtype):
    # ATTN_VARIANTS applies to every head dim and dtype (with GPU_CONFIGS / GPU_CONFIGS_FP32), not only D=128 bf16.
    q, k, v = _qkv(777, 1500, 8, 2, d, dtype, seed=d)
    _check(_run(q, k, v, True, variants), flash_attn_with_lse_reference(q, k, v, causal=True), dtype)


# ------------------------------------------------------------------ scripts/tune_attention.py
def _tune_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "tune_attention.py"
    spec = importlib.util.spec_from_file_location("tune_attention_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tune_script_help_and_plan(capsys):
    script = _tune_script()
    with pytest.raises(SystemExit) as exc:
        script.main(["--help"])
    assert exc.value.code == 0
    assert script.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert "phase 1: 22 configs" in out and "WARP_SPECIALIZE" in out
    assert script.visible_pairs(4, 4, True) == 10 and script.visible_pairs(2, 5, True) == 9
    assert script.visible_pairs(5, 2, True) == 3 and script.visible_pairs(3, 4, False) == 12


@pytest.mark.skipif(torch.cuda.is_available(), reason="the self-test runs the Triton interpreter on CPU")
def test_tune_script_cpu_selftest(tmp_path, monkeypatch):
    # The whole tuning flow (phases, checks, ranking, summary, JSON) at tiny sizes under the interpreter.
    import json

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "tune.json"
    assert _tune_script().main(["--cpu-selftest", "--quick", "--no-reference", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"causal_8k", "causal_32k", "noncausal_8k_32k"}
    for case in report["cases"].values():
        assert case["default_vs_fp32_reference"]["ok"]
        assert case["results"] and all(r["status"] == "ok" for r in case["results"])
    assert set(report["best_overall"]["variants"]) == set(attention.ATTN_VARIANTS)


def test_warp_specialize_only_for_head_dims_that_compile(monkeypatch):
    monkeypatch.setattr(attention, "HAS_WARP_SPECIALIZE", True)
    monkeypatch.setattr(attention, "triton_interpret", lambda: False)  # as compiled for a GPU
    for d, expected in ((64, False), (128, True), (256, True)):
        x = torch.randn(4, 2, d)
        flags = attention.effective_attn_variants(x, x, x, x, 1.0, {"WARP_SPECIALIZE": True})
        assert flags["WARP_SPECIALIZE"] is expected, d
