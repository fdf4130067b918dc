"""The Hopper (sm_90) Gluon prefill attention kernel (sparsekv.kernels.attention_sm90) against the fp32 reference,
on fresh random inputs, into NaN-poisoned outputs. Gluon has no CPU interpreter: on CPU only the dispatch rules, the
launcher's errors and, from the kernel compiled for sm_90 without a GPU, its named barrier IDs and its conditional
rescale's PTX are checked."""
from __future__ import annotations

import math
import re

import pytest
import torch

from sparsekv.kernels import attention, attention_sm90, flash_attn_with_lse, flash_attn_with_lse_reference
from tests.conftest import growing_row_maxima
from tests.kernels.test_dense_attention import _check, _qkv

ON_SM90 = (attention_sm90.HAS_GLUON and torch.cuda.is_available()
           and torch.cuda.get_device_capability() == (9, 0))
sm90_only = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU and Triton's Gluon")


def _run(q, k, v, causal):
    Sq, H, _ = q.shape
    o = torch.full_like(q, float("nan"))
    lse = torch.full((H, Sq), float("nan"), dtype=torch.float32, device=q.device)
    attention_sm90.flash_attn_sm90(q, k, v, 1.0 / math.sqrt(q.shape[2]), causal, out=(o, lse))
    return o, lse


# (Sq, Sk, H, KVH, causal): off the 128 grid, Sq < Sk (a chunk against its prefix), Sq > Sk (leading rows with no
# key), one query tile whose second warp group has no rows, a chunk against a long prefix, real head counts; and
# programs with as many key blocks as K/V slots, or one more (the first refill), where every slot release and turn
# must meet its wait for the next program's barriers to start clean
SHAPES = [(300, 300, 4, 2, True), (1000, 1000, 8, 2, True), (77, 1000, 4, 1, True), (256, 700, 4, 2, False),
          (1000, 333, 4, 2, True), (40, 40, 2, 2, True), (2048, 16384, 32, 8, False), (4096, 4096, 32, 8, True),
          (129, 256, 2, 1, False), (256, 384, 2, 1, False)]


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("sq, sk, h, kvh, causal", SHAPES)
def test_gpu_matches_reference(sq, sk, h, kvh, causal):
    q, k, v = _qkv(sq, sk, h, kvh, 128, torch.bfloat16, seed=sq + sk + h)
    _check(_run(q, k, v, causal), flash_attn_with_lse_reference(q, k, v, causal=causal), torch.bfloat16)


# (Sq, Sk, H, KVH, causal, q's scale, keys' norms growing along the sequence): rows whose max keeps outgrowing the
# stale one by more than RESCALE_THRESHOLD, so that warps rescale at different blocks
GROWING_MAX = [(1000, 1000, 4, 2, True, 6.0, False), (2048, 4096, 8, 2, False, 6.0, True),
               (3000, 3000, 4, 1, True, 3.0, True), (512, 8192, 4, 1, False, 10.0, True)]


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("sq, sk, h, kvh, causal, q_scale, growing", GROWING_MAX)
def test_gpu_matches_reference_as_row_maxima_grow(sq, sk, h, kvh, causal, q_scale, growing):
    q, k, v = _qkv(sq, sk, h, kvh, 128, torch.bfloat16, seed=sq + sk + h)
    scaled_q, rising_k = growing_row_maxima(q, k, q_scale)
    q, k = scaled_q, (rising_k if growing else k)
    _check(_run(q, k, v, causal), flash_attn_with_lse_reference(q, k, v, causal=causal), torch.bfloat16)


@pytest.mark.gpu
@sm90_only
def test_gpu_fp16_and_public_api_take_it(monkeypatch):
    q, k, v = _qkv(700, 1500, 8, 2, 128, torch.float16, seed=3)
    _check(_run(q, k, v, True), flash_attn_with_lse_reference(q, k, v, causal=True), torch.float16)
    calls = []
    original = attention.flash_attn_sm90
    monkeypatch.setattr(attention, "flash_attn_sm90", lambda *a, **kw: calls.append(a[0].shape) or original(*a, **kw))
    out = flash_attn_with_lse(q, k, v, causal=True)
    assert calls == [q.shape]
    _check(out, flash_attn_with_lse_reference(q, k, v, causal=True), torch.float16)


def test_calls_it_cannot_serve_go_elsewhere():
    q, k, v = _qkv(64, 64, 4, 2, 128, torch.float32)
    assert not attention_sm90.sm90_attention_ok(q, k, v)  # fp32 (and, on CPU, no GPU)
    with pytest.raises(ValueError, match="use flash_attn_with_lse"):
        attention_sm90.flash_attn_sm90(q, k, v, 0.1, True)
    if ON_SM90:
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        assert attention_sm90.sm90_attention_ok(qb, kb, vb)
        assert not attention_sm90.sm90_attention_ok(qb[..., :64], kb[..., :64], vb[..., :64])  # D = 64
        wide = torch.zeros(64, 4, 256, dtype=torch.bfloat16, device=q.device)[..., :128]  # heads 256 apart
        assert not attention_sm90.sm90_attention_ok(wide, kb, vb)


def compiled_barriers_and_rescale(cache) -> None:
    """Compile the kernel for sm_90 (no GPU: tests.unit.test_compile_ahead's HopperDriver) and read the PTX."""
    q, k, v = (torch.zeros(300, heads, 128, dtype=torch.bfloat16) for heads in (8, 2, 2))
    grid, args, constants = attention_sm90.kernel_launch(q, k, v, torch.zeros_like(q), torch.zeros(8, 300), 0.1, True)
    ptx = attention_sm90._flash_fwd_sm90_kernel.warmup(*args, grid=grid, **constants).asm["ptx"]
    tritons = {int(n) for n in re.findall(r"\b(?:bar|barrier)\.\w+(?:\.\w+)*\s+(\d+)", ptx)}  # immediate IDs
    ours = set(range(attention_sm90.NAMED_BARRIER_BASE, attention_sm90.NAMED_BARRIER_BASE + 2 * attention_sm90.STAGES))
    assert tritons and max(tritons) < attention_sm90.NAMED_BARRIER_BASE, tritons
    assert max(ours) < attention_sm90.TURN_BARRIER and attention_sm90.TURN_BARRIER + 1 < 16  # 16 per CTA
    assert re.search(r"bar\.sync\s+%r\d+, 384", ptx) and re.search(r"bar\.arrive\s+%r\d+, 256", ptx)
    # the conditional rescale: every accumulator register times an alpha, and the vote reads the alphas
    rescale = next(line for line in ptx.splitlines() if "vote.sync.any.pred" in line)  # one consumer's
    setps = re.findall(r"setp\.neu\.f32\s+\w+, (%r\d+), 0f3F800000", rescale)
    products = re.findall(r"mul\.f32\s+(%r\d+), (%r\d+), (%r\d+);", rescale)
    accumulators = {a for a, _, _ in products}
    alphas = {c for _, _, c in products}
    assert len(products) == len(accumulators) == 64 and all(a == b for a, b, _ in products), products[:4]
    assert alphas.isdisjoint(accumulators) and len(setps) == 2 and set(setps) <= alphas, (setps, alphas)


def test_compiled_kernel_barriers_and_rescale(tmp_path):
    """The kernel's turns (TURN_BARRIER on) and slot releases (NAMED_BARRIER_BASE on) must not share an ID with the
    barriers Triton's warp_specialize emits itself (0-3 in Triton 3.6 and 3.9): a shared ID would hang or race. The
    rescale's inline PTX must multiply each accumulator register by an alpha, in place, and vote on the alphas."""
    if not attention_sm90.HAS_GLUON:
        pytest.skip("Triton without Gluon's Hopper layer")
    from tests.unit.test_compile_ahead import compile_ahead, in_fresh_process

    if not compile_ahead.supported():
        pytest.skip("Triton without knobs.runtime.jit_cache_hook")
    in_fresh_process("compiled_barriers_and_rescale", tmp_path / "triton",
                     module="tests.kernels.test_attention_sm90")
