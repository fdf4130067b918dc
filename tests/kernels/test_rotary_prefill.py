"""apply_rotary's prefill tiling (several tokens and up to all q heads per program) against its decode tiling (one
token per program) and the torch reference, on ragged token counts, GQA shapes, with and without q/k norm and the
KV-cache write. The prefill path is forced by lowering rotary.PREFILL_MIN_TOKENS; on CPU the kernel runs under the
Triton interpreter (see tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import rotary as rotary_module
from sparsekv.kernels.rotary import KVWrite, apply_rotary, apply_rotary_reference
from sparsekv.layers.rotary import rope_inv_freq
from tests.conftest import CountLaunches

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5  # fp32 relative error, as in test_fused_kernels.py
BLOCK_SIZE = 8  # cache block size of these tests
DECODE = dict(PREFILL_MIN_TOKENS=1 << 40)

pytestmark = pytest.mark.usefixtures("triton_kernels")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _inputs(n: int, h: int, kvh: int, d: int, qk_norm: bool, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = (torch.randn(n, (h + 2 * kvh) * d, generator=g) * 2.0).to(DEV)  # strided views of one projection
    q = qkv[:, :h * d].view(n, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(n, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(n, kvh, d)
    positions = torch.randint(0, 200_000, (n,), generator=g).to(DEV)
    weights = (torch.randn(d, generator=g).to(DEV), torch.randn(d, generator=g).to(DEV)) if qk_norm else (None, None)
    num_blocks = (n + BLOCK_SIZE - 1) // BLOCK_SIZE + 2  # spare slots that must stay untouched
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:n].to(DEV)
    return q, k, v, positions, weights, num_blocks, slots


def _run(monkeypatch, constants: dict, q, k, v, positions, inv_freq, weights, num_blocks, slots, kv_write: bool):
    """(q_out, k_out, k_cache, v_cache) under the given module constants; caches None without kv_write."""
    for name, value in constants.items():
        monkeypatch.setattr(rotary_module, name, value)
    caches = None
    kv = None
    if kv_write:
        caches = [torch.full((num_blocks, BLOCK_SIZE, *k.shape[1:]), 7.0, device=DEV) for _ in range(2)]
        kv = KVWrite(v, caches[0], caches[1], slots)
    q_out, k_out = apply_rotary(q, k, positions, inv_freq, 0.8, *weights, 1e-6, kv)
    return (q_out, k_out, *(caches or (None, None)))


@pytest.mark.parametrize("n, h, kvh, d", [(13, 8, 2, 32), (11, 4, 4, 32), (6, 6, 3, 12)])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("kv_write", [False, True])
@pytest.mark.parametrize("tile", [(4, 1, 4), (8, 8, 8), None])
def test_prefill_tiling_equals_decode_tiling_and_reference(monkeypatch, n, h, kvh, d, qk_norm, kv_write, tile):
    """tile (4, 1, 4): four tokens, decode's head blocks; (8, 8, 8): eight tokens, all q heads in one program
    (n is not a multiple of BLOCK_T: the last token block is ragged); None: the module's PREFILL_TILE."""
    q, k, v, positions, weights, num_blocks, slots = _inputs(n, h, kvh, d, qk_norm, seed=n * 10 + h + qk_norm)
    inv_freq = rope_inv_freq(d, 1e6, None)[0].to(DEV)
    args = (q, k, v, positions, inv_freq, weights, num_blocks, slots, kv_write)
    decode = _run(monkeypatch, DECODE, *args)
    prefill = _run(monkeypatch, dict(PREFILL_MIN_TOKENS=1, PREFILL_TILE=tile or rotary_module.PREFILL_TILE), *args)
    for a, b in zip(prefill, decode):
        assert (a is None and b is None) or torch.equal(a, b)
    ref_q, ref_k = apply_rotary_reference(q, k, positions, inv_freq, 0.8, *weights, 1e-6)
    for out, ref in zip(prefill[:2], (ref_q, ref_k)):
        assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
        assert not out.isnan().any()
        assert _rel_err(out, ref) < TOL
    if kv_write:
        k_cache, v_cache = (c.view(-1, kvh, d) for c in prefill[2:])
        assert torch.equal(k_cache[slots], prefill[1]) and torch.equal(v_cache[slots], v)
        untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=DEV)
        untouched[slots] = False
        assert untouched.sum() >= 2 * BLOCK_SIZE
        assert (k_cache[untouched] == 7.0).all() and (v_cache[untouched] == 7.0).all()


def test_launcher_picks_the_tiling_from_the_token_count(monkeypatch):
    """Below PREFILL_MIN_TOKENS the decode grid (one token per program, k's head block for q too); from it the
    prefill grid of PREFILL_TILE, with q's head block capped at the (rounded) q head count."""
    counter = CountLaunches(rotary_module._rotary_kernel)
    monkeypatch.setattr(rotary_module, "_rotary_kernel", counter)
    monkeypatch.setattr(rotary_module, "PREFILL_MIN_TOKENS", 10)
    monkeypatch.setattr(rotary_module, "PREFILL_TILE", (4, 64, 8))
    h, kvh, d = 8, 2, 32
    inv_freq = rope_inv_freq(d, 1e6, None)[0].to(DEV)
    for n in (9, 10):
        q, k, _, positions, _, _, _ = _inputs(n, h, kvh, d, False, seed=n)
        apply_rotary(q, k, positions, inv_freq, 1.0)
    # decode: 9 tokens x (4 q blocks + 1 k block of 2 heads); prefill: 3 token blocks x (1 q block of 8 + 1 k block)
    assert counter.grids == [(9, 4 + 1), (3, 1 + 1)]


@pytest.mark.parametrize("tile", [(1, 32, 2), (16, 64, 4), (32, 8, 64), (8, 1, 1), (1, 8, 1)])
def test_prefill_tile_keeps_the_decode_split_and_the_per_thread_cap(monkeypatch, tile):
    """Whatever PREFILL_TILE asks for, the tile that runs has the decode tile's warps along D, at least its elements
    per thread, at most PREFILL_MAX_PER_THREAD of them (once shrunk to decode's head block and one token, decode's
    own count), and decode's head block or more for q."""
    monkeypatch.setattr(rotary_module, "PREFILL_MIN_TOKENS", 1)
    monkeypatch.setattr(rotary_module, "PREFILL_TILE", tile)
    for h, kvh, d in ((32, 8, 128), (16, 2, 64), (8, 1, 256), (64, 8, 256), (4, 4, 32), (6, 3, 12), (8, 1, 512)):
        block_half = 1 << (d // 2 - 1).bit_length()
        block_h = min(1 << (kvh - 1).bit_length(), rotary_module.MAX_TILE // block_half)
        block_t, block_hq, num_warps, vec = rotary_module._tiling(100, h, block_h, block_half)
        decode_per_thread = block_h * block_half / (32 * rotary_module.NUM_WARPS)
        assert block_t * block_h * block_half / (32 * num_warps) >= decode_per_thread
        assert block_t * block_hq * block_half / (32 * num_warps) <= max(rotary_module.PREFILL_MAX_PER_THREAD,
                                                                         decode_per_thread)
        assert block_hq >= block_h and vec == min(block_half, max(1, int(decode_per_thread)))
        # a head's half spans as many warps as in the decode tile (32 lanes, at least one element each)
        assert num_warps == 4 if block_half > 128 else num_warps >= min(4, block_half // 32)


@pytest.mark.gpu
def test_prefill_tiling_at_qwen3_4b_shapes_on_gpu(monkeypatch):
    """bf16 at Qwen3-4B shapes, enough tokens for the module's own prefill tiling: the same bits as the decode
    tiling (q, k and the cache), within bf16 rounding of the reference, every cache slot it owns written."""
    n, h, kvh, d = rotary_module.PREFILL_MIN_TOKENS + 37, 32, 8, 128
    g = torch.Generator(device="cpu").manual_seed(11)
    qkv = torch.randn(n, (h + 2 * kvh) * d, generator=g).to(DEV, torch.bfloat16)
    q, k, v = (qkv[:, a * d:b * d].view(n, -1, d) for a, b in ((0, h), (h, h + kvh), (h + kvh, h + 2 * kvh)))
    positions = torch.randint(0, 131072, (n,), generator=g).to(DEV)
    weights = tuple(torch.randn(d, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    num_blocks = n // 256 + 2
    slots = torch.randperm(num_blocks * 256, generator=g)[:n].to(DEV)
    inv_freq = rope_inv_freq(d, 1e6, None)[0].to(DEV)

    def run() -> tuple[torch.Tensor, ...]:
        caches = [torch.full((num_blocks, 256, kvh, d), float("nan"), device=DEV, dtype=torch.bfloat16)
                  for _ in range(2)]
        q_out, k_out = apply_rotary(q, k, positions, inv_freq, 1.0, *weights, 1e-6, KVWrite(v, *caches, slots))
        return (q_out, k_out, *(c.view(-1, kvh, d)[slots] for c in caches))

    prefill = run()  # the module's PREFILL_MIN_TOKENS and PREFILL_TILE
    for name, value in DECODE.items():
        monkeypatch.setattr(rotary_module, name, value)
    decode = run()
    for a, b in zip(prefill, decode):
        assert not a.isnan().any() and torch.equal(a, b)
    ref = apply_rotary_reference(q, k, positions, inv_freq, 1.0, *weights, 1e-6)
    for out, r in zip(prefill[:2], ref):
        assert _rel_err(out, r) < 5e-3
    assert torch.equal(prefill[3], v)
