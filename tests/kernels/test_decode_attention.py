"""The flash-decoding kernel for few query rows (sparsekv/kernels/decode_attention.py) against the pure-torch
reference, and flash_attn_with_lse's dispatch of small Sq to it.

On CPU the kernel runs under the Triton interpreter (the `triton_kernels` fixture). The interpreter's tl.dot
multiplies bf16 operands as their raw uint16 bits; the `bf16_dot` fixture makes it multiply their values, so the
CPU bf16 tests check everything else of the bf16 path (loads, the p -> bf16 cast, the stores; note the interpreter
also rounds fp32 -> bf16 toward zero). The GPU-marked tests run the real bf16 kernel.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import flash_attn_with_lse, flash_attn_with_lse_reference, resolve_kernels
from sparsekv.kernels import attention as attention_module
from sparsekv.kernels import decode_attention as decode_module
from sparsekv.kernels.decode_attention import DecodePartials, choose_num_splits, launch_plan
from tests.kernels.test_kernels import DEV, _check_attn, _qkv

TRITON = resolve_kernels(DEV, backend="triton")


def decode_attention(q, k, v, scale=None, causal=False, *, num_splits=None):
    """flash_attn_with_lse on the Triton path (few rows: the decode kernel); num_splits forces the split count."""
    if num_splits is None:
        return flash_attn_with_lse(q, k, v, scale, causal, kernels=TRITON)
    return decode_module.decode_attention_triton(q, k, v, scale or q.shape[2] ** -0.5, causal, num_splits)

pytestmark = pytest.mark.usefixtures("triton_kernels")
gpu = pytest.mark.gpu


@pytest.fixture
def bf16_dot(monkeypatch):
    """Off-GPU: let the Triton interpreter's tl.dot take bf16 operands by value (see the module docstring)."""
    if DEV.type == "cuda":
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    bf16 = interpreter.tl.bfloat16

    def create_dot(self, a, b, d, *args, **kwargs):
        a = self.cast_impl(a, interpreter.tl.float32) if a.dtype.scalar == bf16 else a
        b = self.cast_impl(b, interpreter.tl.float32) if b.dtype.scalar == bf16 else b
        return original(self, a, b, d, *args, **kwargs)

    monkeypatch.setattr(builder, "create_dot", create_dot)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Grids the decode split kernel was launched with (so a test knows the Triton kernel, not a fallback, ran)."""
    calls = []
    kernel = decode_module._decode_split_kernel
    spy = type("Spy", (), {"__getitem__": lambda _, grid: (calls.append(grid), kernel[grid])[1]})()
    monkeypatch.setattr(decode_module, "_decode_split_kernel", spy)
    return calls


def _case(sq, sk, h, kvh, d, causal, dtype=torch.float32, seed=0, scale=None, num_splits=None, calls=None):
    q, k, v = _qkv(sq, sk, h, kvh, d, dtype, seed=seed)
    out = decode_attention(q, k, v, scale, causal, num_splits=num_splits)
    _check_attn(out, flash_attn_with_lse_reference(q, k, v, scale, causal), dtype)
    if calls is not None:
        assert calls, "the Triton decode kernel did not run"
    return out


# ------------------------------------------------------------------ against the reference
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sk", [1, 5, 64, 300])
@pytest.mark.parametrize("sq", [1, 3, 16])
def test_decode_matches_reference(sq, sk, causal, kernel_calls):
    # GQA group 4 (H=8, KVH=2); Sk=300 runs 3 splits of 128 keys, the last one partial.
    _case(sq, sk, 8, 2, 64, causal, seed=sq * 1000 + sk, calls=kernel_calls)


@pytest.mark.parametrize("sq,sk,causal", [(1, 300, False), (3, 64, True), (16, 5, True), (16, 64, False)])
@pytest.mark.parametrize("h,kvh", [(4, 4), (8, 1)])
def test_decode_gqa_groups(h, kvh, sq, sk, causal, kernel_calls):
    # group 1 and 8; Sq=16 with group 8 is 128 rows: two 64-row tiles per kv head.
    _case(sq, sk, h, kvh, 64, causal, seed=h + sq + sk, calls=kernel_calls)


@pytest.mark.parametrize("sq,sk,causal", [(1, 300, False), (3, 70, True), (16, 40, True)])
def test_decode_head_dim_128_and_scale(sq, sk, causal, kernel_calls):
    _case(sq, sk, 8, 2, 128, causal, seed=sk, scale=0.3, calls=kernel_calls)


@pytest.mark.parametrize("sq,sk,causal,d", [(1, 300, False, 64), (3, 64, True, 128), (16, 5, True, 64)])
def test_decode_bf16(sq, sk, causal, d, bf16_dot, kernel_calls):
    _case(sq, sk, 8, 2, d, causal, torch.bfloat16, seed=d + sk, calls=kernel_calls)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 1000])
def test_decode_forced_splits(num_splits, kernel_calls):
    # Splits start on BLOCK_N boundaries: 1000 asked for becomes one per key block.
    _case(3, 150, 8, 2, 64, True, seed=num_splits, num_splits=num_splits, calls=kernel_calls)
    splits = kernel_calls[-1][2]
    assert splits <= num_splits and (splits > 1) == (num_splits > 1)


def test_decode_rows_without_keys():
    # Causal with Sq > Sk: query i sees keys j <= i - 11, so rows 0..10 see nothing: lse -inf and o 0.
    q, k, v = _qkv(16, 5, 8, 2, 64, seed=3)
    o, lse = decode_attention(q, k, v, causal=True)
    assert torch.isneginf(lse[:, :11]).all() and torch.isfinite(lse[:, 11:]).all()
    assert (o[:11] == 0).all()
    _check_attn((o, lse), flash_attn_with_lse_reference(q, k, v, causal=True), q.dtype)
    # Row 0 sees keys 0..284 of 300: with splits of 32 keys its last split is empty and must merge as nothing.
    q, k, v = _qkv(16, 300, 4, 1, 64, seed=4)
    ref = flash_attn_with_lse_reference(q, k, v, causal=True)
    _check_attn(decode_attention(q, k, v, causal=True, num_splits=10), ref, q.dtype)


def test_decode_strided_kv_views(kernel_calls):
    h, kvh, d, block_size = 8, 2, 64, 16
    g = torch.Generator().manual_seed(0)
    # GPU ring slots [num_slots, block_size, KVH, D]: a run of consecutive slots, flattened to [n * bs, KVH, D].
    k_slots = torch.randn(9, block_size, kvh, d, generator=g).to(DEV)
    v_slots = torch.randn(9, block_size, kvh, d, generator=g).to(DEV)
    q = torch.randn(1, h, d, generator=g).to(DEV)
    k, v = k_slots[3:8].flatten(0, 1), v_slots[3:8].flatten(0, 1)  # [80, KVH, D], storage offset 3 slots
    ref = flash_attn_with_lse_reference(q, k.contiguous(), v.contiguous())
    _check_attn(decode_attention(q, k, v), ref, q.dtype)
    # Truly strided: K and V interleaved in one [N, 2, KVH, D] buffer, q/k sliced out of a packed projection.
    kv = torch.randn(100, 2, kvh, d, generator=g).to(DEV)
    qkv = torch.randn(100, h + kvh, d, generator=g).to(DEV)
    q, k, v = qkv[-3:, :h], qkv[:, h:], kv[:, 1]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    ref = flash_attn_with_lse_reference(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    _check_attn(decode_attention(q, k, v, causal=True), ref, q.dtype)
    assert len(kernel_calls) >= 2


def test_decode_empty_and_bad_inputs():
    q, k, v = _qkv(3, 0, 8, 2, 64)
    o, lse = decode_attention(q, k, v)
    assert o.shape == (3, 8, 64) and (o == 0).all() and lse.shape == (8, 3) and torch.isneginf(lse).all()
    q, k, v = _qkv(0, 9, 8, 2, 64)
    o, lse = decode_attention(q, k, v, causal=True)
    assert o.shape == (0, 8, 64) and lse.shape == (8, 0)
    q, k, v = _qkv(2, 9, 8, 2, 64)
    with pytest.raises(ValueError, match=r"\(2, 3, 64\)"):
        decode_attention(q[:, :3], k, v)  # H=3 not a multiple of KVH=2
    with pytest.raises(ValueError, match=r"\(9, 2, 64\).*\(8, 2, 64\)"):
        decode_attention(q, k, v[:8])
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q.double(), k, v)
    q, k, v = _qkv(1, 9, 8, 2, 48)
    with pytest.raises(ValueError, match="D=48"):
        decode_attention(q, k, v)


@pytest.mark.parametrize("sizes", [(5,), (0, 300, 7), (64, 1, 1, 200)])
def test_decode_partials_merge_key_sets(sizes, kernel_calls):
    """Split partials of several disjoint key sets, merged by one reduce, equal attention over their union."""
    sq, h, kvh, d = 1, 8, 2, 32
    total = sum(sizes)
    q, k, v = _qkv(sq, total, h, kvh, d, seed=total)
    partials = DecodePartials(q, d ** -0.5, max_sets=len(sizes), splits_per_set=3)
    start = 0
    for n in sizes:
        partials.add(k[start:start + n], v[start:start + n])
        start += n
    _check_attn(partials.finish(), flash_attn_with_lse_reference(q, k, v, d ** -0.5), torch.float32)
    assert len(kernel_calls) == sum(1 for n in sizes if n), "one split-kernel launch per non-empty key set"
    assert partials.count <= 3 * len(sizes)


@pytest.mark.parametrize("length", [1, 31, 64, 65, 200])
def test_decode_partials_device_length(length, kernel_calls):
    """add(..., length=t) over a 200-key buffer attends to its first t keys only, t read on the device: the same
    launch (grid, splits) serves every t, as a replayed graph needs; the other keys may hold anything."""
    q, k, v = _qkv(1, 200, 8, 2, 32, seed=length)
    k[length:], v[length:] = 1e4, float("nan")  # never read as keys: they would swamp or poison the result
    tail = torch.tensor([length], dtype=torch.int64, device=q.device)
    partials = DecodePartials(q, 32 ** -0.5, max_sets=2, splits_per_set=4)
    partials.add(k, v, length=tail)
    _, head_k, head_v = _qkv(1, 50, 8, 2, 32, seed=99)
    partials.add(head_k, head_v)
    want = flash_attn_with_lse_reference(q, torch.cat([k[:length], head_k]), torch.cat([v[:length], head_v]),
                                         32 ** -0.5)
    _check_attn(partials.finish(), want, torch.float32)
    _, _, row_tiles, splits, _ = launch_plan(1, 8, 2, 200, 32, 4, q.device, max_splits=4)
    assert splits > 1 and kernel_calls[0] == (row_tiles, 2, splits)  # planned from the buffer, not from t


def test_decode_partials_reuse_their_buffers_but_never_share_them(kernel_calls):
    """Consecutive DecodePartials (one per layer in decode) reuse one split buffer; two alive at once do not."""
    q, k, v = _qkv(1, 300, 8, 2, 32, seed=5)
    first = DecodePartials(q, 32 ** -0.5, max_sets=2)
    second = DecodePartials(q, 32 ** -0.5, max_sets=2)  # alive together with the first: its own buffers
    assert first.o_part.data_ptr() != second.o_part.data_ptr()
    first.add(k[:100], v[:100])
    second.add(k[100:], v[100:])
    first.add(k[100:], v[100:])
    _check_attn(first.finish(), flash_attn_with_lse_reference(q, k, v, 32 ** -0.5), torch.float32)
    _check_attn(second.finish(), flash_attn_with_lse_reference(q, k[100:], v[100:], 32 ** -0.5), torch.float32)
    third = DecodePartials(q, 32 ** -0.5, max_sets=1)  # after a finish: a returned buffer, not a new one
    assert third.o_part.data_ptr() in (first.o_part.data_ptr(), second.o_part.data_ptr())
    third.add(k[:7], v[:7])
    _check_attn(third.finish(), flash_attn_with_lse_reference(q, k[:7], v[:7], 32 ** -0.5), torch.float32)


def test_decode_partials_keep_outgrown_buffers_alive(kernel_calls):
    """A longer context outgrows the shared split buffers: the bigger ones replace them, and the old ones stay
    allocated, since a CUDA graph captured earlier may still address them."""
    q, k, v = _qkv(1, 300, 8, 2, 32, seed=6)
    small = DecodePartials(q, 32 ** -0.5, max_sets=1)
    small.add(k, v)
    small.finish()
    retired = len(decode_module._RETIRED)
    large = DecodePartials(q, 32 ** -0.5, max_sets=64)
    assert large.o_part.shape[2] > small.o_part.shape[2]
    assert any(parts[0] is small.o_part for parts in decode_module._RETIRED[retired:])
    large.add(k, v)
    _check_attn(large.finish(), flash_attn_with_lse_reference(q, k, v, 32 ** -0.5), torch.float32)


def test_decode_partials_empty_and_overflow():
    q, k, v = _qkv(1, 40, 4, 2, 16, seed=1)
    o, lse = DecodePartials(q, 0.25, max_sets=1).finish()
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))
    partials = DecodePartials(q, 0.25, max_sets=1, splits_per_set=1)
    partials.add(k, v)
    with pytest.raises(RuntimeError, match="raise max_sets"):
        partials.add(k, v)


def test_choose_num_splits():
    dev = torch.device("cpu")  # 132 SMs assumed off-GPU
    assert choose_num_splits(1, 8, decode_module.MIN_SPLIT_TOKENS, dev) == 1
    assert choose_num_splits(1, 8, decode_module.MIN_SPLIT_TOKENS + 1, dev) == 2
    many = choose_num_splits(1, 8, 1 << 20, dev)
    assert many <= decode_module.MAX_SPLITS and many * 8 >= decode_module.PROGRAMS_PER_SM * 132
    assert choose_num_splits(4, 8, 1 << 20, dev) <= many


# ------------------------------------------------------------------ dispatch from flash_attn_with_lse
def test_flash_attn_with_lse_dispatches_small_sq(triton_kernels, monkeypatch):
    calls = []
    launcher = decode_module.decode_attention_triton

    def spy(q, *args, **kwargs):
        calls.append(q.shape[0])
        return launcher(q, *args, **kwargs)

    monkeypatch.setattr(decode_module, "decode_attention_triton", spy)
    threshold = attention_module.DECODE_MAX_SQ
    for sq, causal in ((1, False), (1, True), (threshold, True), (threshold + 1, True)):
        q, k, v = _qkv(sq, 40, 8, 2, 64, seed=sq)
        ref = flash_attn_with_lse_reference(q, k, v, causal=causal)
        _check_attn(flash_attn_with_lse(q, k, v, causal=causal, kernels=triton_kernels), ref, q.dtype)
    assert calls == [1, 1, threshold]  # Sq above the threshold runs the prefill kernel


# ------------------------------------------------------------------ GPU only
@gpu
@pytest.mark.parametrize("sk", [1, 7, 64, 255, 256, 1000, 4096, 4097, 8192])
def test_gpu_decode_bf16_realistic(sk):
    q, k, v = _qkv(1, sk, 32, 8, 128, torch.bfloat16, seed=sk)
    ref = flash_attn_with_lse_reference(q, k, v)
    _check_attn(flash_attn_with_lse(q, k, v), ref, torch.bfloat16)  # dispatched to the decode kernel
    _check_attn(decode_attention(q, k, v), ref, torch.bfloat16)
    _check_attn(decode_attention(q, k, v, num_splits=1), ref, torch.bfloat16)
    # Ring-slot view: a run of 256-token slots out of a bigger buffer.
    n = -(-sk // 256)
    slots = torch.randn(n + 3, 256, 8, 128, device=DEV, dtype=torch.bfloat16)
    ks, vs = slots[2:2 + n].flatten(0, 1)[:sk], slots[1:1 + n].flatten(0, 1)[:sk]
    ref = flash_attn_with_lse_reference(q, ks, vs)
    _check_attn(flash_attn_with_lse(q, ks, vs), ref, torch.bfloat16)


@gpu
@pytest.mark.parametrize("sq,sk", [(3, 4096), (16, 8192), (16, 5), (8, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_decode_causal_small_sq(sq, sk, dtype):
    for h, kvh, d in ((32, 8, 128), (16, 2, 64), (8, 1, 256)):
        q, k, v = _qkv(sq, sk, h, kvh, d, dtype, seed=sq + sk)
        for causal in (False, True):
            ref = flash_attn_with_lse_reference(q, k, v, causal=causal)
            _check_attn(flash_attn_with_lse(q, k, v, causal=causal), ref, dtype)
