"""Tests of sparsekv.kernels.gemv (the skinny linear of decode) and of the Linear layer that switches to it.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by conftest; the `triton_kernels`
fixture also poisons every output buffer the launchers allocate, split-K partials included). The interpreter
rounds fp32 -> bf16 toward zero (GPUs round to nearest even), so bf16 gets one bf16 ulp of slack; under the
interpreter bf16 tl.dot runs on operands upcast to fp32 (numpy has no bf16 matmul). Real sizes run in the
GPU-marked tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import sparsekv.factory
from sparsekv.kernels import KernelChoice, resolve_kernels
from sparsekv.kernels import gemv as G
from sparsekv.kernels import gemv_configs as GC
from sparsekv.kernels._dispatch import next_power_of_2
from sparsekv.kernels.gemv import GemvConfig, choose_config, skinny_linear, skinny_linear_reference
from sparsekv.layers.linear import Linear
from tests.conftest import CountLaunches

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.gpu

pytestmark = pytest.mark.usefixtures("triton_kernels", "one_thread")

# elementwise |out - ref| <= ATOL + RTOL * |ref| for outputs of magnitude ~1
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}

QWEN3_4B = ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151936, 2560))
LLAMA_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))


@pytest.fixture
def launches(monkeypatch):
    counter = CountLaunches(G._skinny_linear_kernel)
    monkeypatch.setattr(G, "_skinny_linear_kernel", counter)
    return counter


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool = False, seed: int = 0):
    """x [m, k], weight [n, k] scaled so that outputs are ~1, bias [n] or None; fresh random values per seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    return x, w, b


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.device == ref.device
    assert not out.isnan().any(), "an output element was not written (poisoned buffer)"
    atol, rtol = TOL[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------- kernel vs reference
# The three code paths (name, M, config) with small tiles, so that N = 50 and K = 100 are ragged in both: 4 row
# blocks of 16, 7 K tiles of 16 (the last one 4 wide); split_k = 3 gives splits of 48, 48 and 4.
PATHS = [("gemv", 1, GemvConfig(16, 16, 4, 1, 1, False, 1))]
PATHS += [("fma3d", m, GemvConfig(16, 16, 4, 1, 1, False, next_power_of_2(m))) for m in (3, 8, 16)]
PATHS += [("dot", m, GemvConfig(16, 16, 4, 2, 1, True, 16)) for m in (1, 3, 8, 16)]
PATHS += [("gemv-pipelined", 1, GemvConfig(16, 16, 4, 3, 1, False, 1))]  # tl.range(num_stages=3) K loop


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path,m,config", PATHS, ids=[f"{p}-M{m}" for p, m, _ in PATHS])
def test_paths_match_reference(path, m, config, dtype, split, bias, launches):
    n, k = 50, 100
    x, w, b = _inputs(m, n, k, dtype, bias, seed=m * 7 + split)
    config = config._replace(split_k=split)
    assert GC.split_length(k, config) == (48 if split == 3 else 112)
    out = skinny_linear(x, w, b, config=config)
    assert launches.calls == 1
    _check(out, skinny_linear_reference(x, w, b))


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(50, 100), (20, 4096), (70, 48)])
def test_default_config_matches_reference(m, n, k, launches):
    """The heuristic's config (the table's tiles clamped to the problem; at N = 20, K = 4096 it splits K)."""
    x, w, b = _inputs(m, n, k, torch.float32, bias=m % 2 == 1, seed=m + n)
    config = choose_config(m, n, k, 4, DEV)
    assert config.block_m >= m and config.block_k <= max(16, next_power_of_2(k))
    if (n, k) == (20, 4096):
        assert config.split_k > 1
    _check(skinny_linear(x, w, b), skinny_linear_reference(x, w, b))
    assert launches.calls == 1


def test_split_k_is_deterministic_and_close_to_no_split():
    x, w, b = _inputs(5, 40, 300, torch.float32, bias=True, seed=3)
    base = GemvConfig(16, 32, 4, 2, 1, True, 16)
    whole = skinny_linear(x, w, b, config=base)
    split = base._replace(split_k=4)
    first, second = skinny_linear(x, w, b, config=split), skinny_linear(x, w, b, config=split)
    assert torch.equal(first, second)  # partials summed in split order: bit-identical run to run
    _check(first, whole)


def test_strided_inputs(launches):
    """x as a column slice of a wider buffer (row stride != K) and a transposed (non-contiguous) weight."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(4, 90, generator=g).to(DEV)
    x = big[:, 10:74]  # [4, 64], row stride 90
    w = (torch.randn(64, 36, generator=g) * 0.125).to(DEV).t()  # [36, 64], stride (1, 36)
    _check(skinny_linear(x, w), skinny_linear_reference(x, w))
    assert launches.calls == 1


def test_fallback_beyond_max_m_and_for_empty_inputs(launches):
    x, w, b = _inputs(G.MAX_M + 1, 24, 40, torch.float32, bias=True)
    assert torch.equal(skinny_linear(x, w, b), F.linear(x, w, b))
    assert skinny_linear(x[:0], w).shape == (0, 24)
    empty_k = skinny_linear(torch.zeros(2, 0, device=DEV), torch.zeros(24, 0, device=DEV), b)
    assert torch.equal(empty_k, b.expand(2, 24))
    assert launches.calls == 0
    skinny_linear(x[:G.MAX_M], w, b)
    assert launches.calls == 1


def test_bad_inputs_raise_value_error():
    x, w, b = _inputs(2, 8, 16, torch.float32, bias=True)
    cases = [
        ((x, w[:, :12]), "K=16"),  # mismatched K
        ((x[None], w), r"x \[M, K\]"),  # 3-d x
        ((x, w[0]), r"weight \[N, K\]"),  # 1-d weight
        ((x, w, b[:5]), r"bias \[N=8\]"),
        ((x, w.to(torch.float16)), "one floating dtype"),
        ((x.to(torch.float16), w, b), "one floating dtype"),
        ((x.to(torch.int32), w.to(torch.int32)), "one floating dtype"),
        ((x, w.to("meta")), "one device"),
        ((x, w, b.to("meta")), "one device"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            skinny_linear(*args)
    with pytest.raises(ValueError, match="holds 1 rows"):
        skinny_linear(x, w, config=GemvConfig(16, 16, 4, 1))


# ---------------------------------------------------------------------------------------------- config heuristic
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_heuristic_on_the_decode_shapes(m, monkeypatch):
    """Pure Python: at the Qwen3-4B / Llama-3.1-8B shapes (bf16, 132 SMs) the split count fills the GPU without
    cutting any program below MIN_PROGRAM_BYTES, splits are BLOCK_K-aligned and none is empty."""
    monkeypatch.setattr(GC, "SHAPE_CONFIGS", ())  # the heuristic itself, not the tuned Qwen3-4B rows
    target = GC.PROGRAMS_PER_SM * 132
    for n, k in QWEN3_4B + LLAMA_8B:
        config = choose_config(m, n, k, 2, "cpu")
        assert config.block_m >= m and config.use_dot == (m > 1)
        row_blocks = -(-n // config.block_n)
        split_len = GC.split_length(k, config)
        assert split_len % config.block_k == 0 and (config.split_k - 1) * split_len < k  # the last split is not empty
        if config.split_k > 1:
            assert config.block_n * split_len * 2 >= GC.MIN_PROGRAM_BYTES, (n, k, config)
            assert row_blocks * (config.split_k - 1) < target  # one split fewer would not have filled the GPU
        else:
            assert row_blocks >= target or config.block_n * k * 2 < 2 * GC.MIN_PROGRAM_BYTES, (n, k, config)
    assert choose_config(m, 2560, 9728, 2, "cpu").split_k > 1  # down_proj: 160 or 80 row blocks alone
    assert choose_config(m, 151936, 2560, 2, "cpu").split_k == 1  # lm_head


def test_heuristic_follows_overridden_constants(monkeypatch):
    monkeypatch.setattr(GC, "SHAPE_CONFIGS", ())  # the CONFIGS heuristic, not the tuned Qwen3-4B rows
    before = choose_config(1, 2560, 9728, 2, "cpu")
    monkeypatch.setattr(GC, "CONFIGS", ((16, False, 8, 512, 8, 1),))
    monkeypatch.setattr(GC, "MAX_SPLIT_K", 2)
    monkeypatch.setattr(GC, "MIN_PROGRAM_BYTES", 32768)
    after = choose_config(1, 2560, 9728, 2, "cpu")
    assert after != before and (after.block_n, after.block_k, after.num_warps) == (8, 512, 8) and after.split_k == 2
    fma3 = choose_config(4, 2560, 9728, 2, "cpu")  # a 3-d FMA row: BLOCK_K cut to FMA_MAX_ACC
    assert not fma3.use_dot and fma3.block_m == 4 and fma3.block_k * 8 * 4 <= GC.FMA_MAX_ACC


SHAPE_ROWS = ((50, 100, True, 16, 32, 4, 3, 2), (40, 96, False, 8, 32, 2, 2, None))


def test_shape_rows_apply_at_one_row_and_fall_back_to_configs(monkeypatch):
    """SHAPE_CONFIGS rows (exact (N, K), M = 1) come before CONFIGS: tensor cores allowed at M = 1, a fixed split
    count (cut so that no split is empty; an explicit split_k still overrides), other shapes and M > 1 untouched."""
    before = {(m, n, k): choose_config(m, n, k, 4, "cpu") for m in (1, 4) for n, k in ((50, 100), (40, 96), (64, 64))}
    monkeypatch.setattr(GC, "SHAPE_CONFIGS", SHAPE_ROWS)
    assert choose_config(1, 50, 100, 4, "cpu") == GemvConfig(16, 32, 4, 3, 2, True, 16)
    assert choose_config(1, 50, 100, 4, "cpu", split_k=1).split_k == 1
    fma = choose_config(1, 40, 96, 4, "cpu")
    assert (fma.use_dot, fma.block_m, fma.block_n, fma.block_k, fma.num_warps, fma.num_stages) == (
        False, 1, 8, 32, 2, 2)
    assert choose_config(1, 40, 96, 4, "cpu") == GC._choose_config(1, 40, 96, 4, 132, None, tuple(GC.CONFIGS),
                                                                  tuple(SHAPE_ROWS[1][2:]), GC.PROGRAMS_PER_SM,
                                                                  GC.MIN_PROGRAM_BYTES, GC.MAX_SPLIT_K, GC.FMA_MAX_ACC)
    for (m, n, k), config in before.items():
        if m > 1 or (n, k) == (64, 64):
            assert choose_config(m, n, k, 4, "cpu") == config
    assert GC.shape_row(1, 64, 64) is None and GC.shape_row(2, 50, 100) is None
    monkeypatch.setattr(GC, "SHAPE_CONFIGS", ((50, 100, True, 16, 32, 4, 3),))
    with pytest.raises(ValueError, match="7 fields"):
        choose_config(1, 50, 100, 4, "cpu")


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shape_rows_match_reference(gated, dtype, monkeypatch, launches):
    """The launches SHAPE_ROWS select (tensor cores at M = 1 in 2 splits at ragged K = 100; the pipelined FMA loop at
    K = 96), plain and gated (silu(gate) * up in x's loads)."""
    monkeypatch.setattr(GC, "SHAPE_CONFIGS", SHAPE_ROWS)
    for n, k in ((50, 100), (40, 96)):
        x, w, _ = _inputs(1, n, k, dtype, seed=n)
        if gated:
            gate_up = torch.cat([x * 2, _inputs(1, n, k, dtype, seed=n + 1)[0]], dim=1)  # [1, 2K]
            _check(G.silu_mul_linear(gate_up, w), G.silu_mul_linear_reference(gate_up, w))
        else:
            _check(skinny_linear(x, w), skinny_linear_reference(x, w))
    assert launches.calls == 2


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("k", [96, 100])
def test_pipelined_gemv_loop_gated_and_split(stages, k, launches):
    """The tl.range(num_stages) K loop of the GEMV path, ragged or not, split or not, gated: equal to the reference."""
    n = 40
    g = torch.Generator().manual_seed(k + stages)
    gate_up = torch.randn(1, 2 * k, generator=g).to(DEV)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV)
    for split in (1, 3):
        config = GemvConfig(8, 16, 2, stages, split, False, 1)
        _check(G.silu_mul_linear(gate_up, w, config=config), G.silu_mul_linear_reference(gate_up, w))
        _check(skinny_linear(gate_up[:, :k], w, config=config), skinny_linear_reference(gate_up[:, :k], w))
    assert launches.calls == 4


# ---------------------------------------------------------------------------------------------- the Linear layer
def _linear(kernels: KernelChoice, weight: torch.Tensor, bias: torch.Tensor) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=True, kernels=kernels).to(DEV)
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(bias)
    return layer


def test_linear_layer_follows_its_kernel_choice(triton_kernels, launches):
    torch.manual_seed(0)
    plain = torch.nn.Linear(40, 24, bias=True).to(DEV)
    x = torch.randn(2, 3, 40, device=DEV)  # 6 rows
    expected = F.linear(x, plain.weight, plain.bias)
    default = _linear(resolve_kernels(DEV, backend="triton"), plain.weight, plain.bias)
    assert default.state_dict().keys() == plain.state_dict().keys()  # checkpoint names unchanged
    assert torch.equal(default(x), expected) and launches.calls == 0  # 6 rows take cuBLAS
    one_row = x[:1, :1]
    one = default(one_row)  # one row takes the kernel on CUDA only
    assert launches.calls == (1 if DEV.type == "cuda" else 0)
    _check(one, F.linear(one_row, plain.weight, plain.bias))
    launches.calls = 0
    reference = _linear(KernelChoice.torch_reference(), plain.weight, plain.bias)
    assert torch.equal(reference(x), expected) and launches.calls == 0
    sixteen = _linear(dataclasses.replace(triton_kernels, gemv_max_rows=G.MAX_M), plain.weight, plain.bias)
    out = sixteen(x)
    assert launches.calls == 1 and out.shape == (2, 3, 24)
    _check(out, skinny_linear_reference(x.reshape(6, 40), plain.weight, plain.bias).view(2, 3, 24))
    sixteen(torch.randn(G.MAX_M + 1, 40, device=DEV))  # prefill-sized: F.linear
    assert launches.calls == 1


def test_linear_builds_on_meta_and_materialises():
    """The loader builds on the meta device, then to_empty: a Linear does the same as nn.Linear."""
    with torch.device("meta"):
        layer = Linear(16, 8, bias=False, kernels=KernelChoice.torch_reference())
    layer = layer.to_empty(device=DEV).to(torch.bfloat16)
    assert layer.weight.device.type == DEV.type and layer.weight.dtype == torch.bfloat16 and layer.bias is None
    assert isinstance(layer, torch.nn.Linear)


def test_tiny_model_greedy_unchanged_with_triton_gemv(qwen3_ckpt, triton_kernels, monkeypatch):
    """A prefill (6 rows: also <= MAX_M) and decode steps of the tiny Qwen3 with the GEMV for up to MAX_M rows:
    the same greedy tokens and last logits as the torch path; every projection and the lm_head ran the kernel."""
    from sparsekv import LLM, SamplingParams
    from tests.conftest import random_prompt

    counter = CountLaunches(G._skinny_linear_kernel)
    monkeypatch.setattr(G, "_skinny_linear_kernel", counter)
    prompt = random_prompt(6, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    overrides = [f"device={DEV.type}", "dtype=float32", "offload.block_size=16", "graph=eager"]
    results = {}
    choices = {"torch": KernelChoice.torch_reference(),
               "triton": dataclasses.replace(triton_kernels, gemv_max_rows=G.MAX_M)}
    for backend, kernels in choices.items():
        monkeypatch.setenv("SPARSEKV_ATTN_BACKEND", backend)  # the kernels the KV store calls
        monkeypatch.setattr(sparsekv.factory, "resolve_kernels", lambda device, kernels=kernels: kernels)
        llm = LLM(str(qwen3_ckpt), overrides=overrides)
        counter.calls = 0  # after the build: on CUDA it runs a warm-up request
        results[backend] = llm.generate([prompt], params)[0].token_ids, llm.engine.runner.last_logits[0].clone()
        if backend == "torch":
            assert counter.calls == 0
    # 3 steps x (3 layers x 4 projections + the lm_head)
    assert counter.calls == 3 * (3 * 4 + 1)
    (torch_tokens, torch_logits), (triton_tokens, triton_logits) = results["torch"], results["triton"]
    assert triton_tokens == torch_tokens
    atol = 1e-4 if DEV.type == "cpu" else 1e-2  # on GPU the Triton attention's fp32 tl.dot runs in tf32
    assert torch.allclose(triton_logits, torch_logits, atol=atol, rtol=0), (triton_logits - torch_logits).abs().max()


# ---------------------------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_gpu_qwen3_4b_shapes_match_cublas(m):
    """bf16 at the real decode shapes against F.linear (cuBLAS): within bf16 rounding of each other."""
    for n, k in QWEN3_4B:
        x, w, _ = _inputs(m, n, k, torch.bfloat16, seed=n + m)
        out, ref = skinny_linear(x, w), F.linear(x, w)
        exact = skinny_linear_reference(x, w)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), exact.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 5e-3


@gpu
def test_gpu_replays_inside_a_cuda_graph():
    """Capture-safe (no host syncs, fixed allocations): replays on new inputs equal eager, bit for bit."""
    x, w, b = _inputs(4, 2560, 9728, torch.bfloat16, bias=True, seed=1)  # split-K at the default config
    assert choose_config(4, 2560, 9728, 2, DEV).split_k > 1
    skinny_linear(x, w, b)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_linear(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_linear(x, w, b)
    for seed in (2, 3):
        x.copy_(_inputs(4, 2560, 9728, torch.bfloat16, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, skinny_linear(x, w, b))


def test_tuned_qwen3_4b_rows_apply_at_one_row():
    """The shipped SHAPE_CONFIGS cover every Qwen3-4B decode GEMV (tuned on an H100) and leave M > 1 alone."""
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):
        row = next(r for r in GC.SHAPE_CONFIGS if r[:2] == (n, k))
        config = choose_config(1, n, k, 2, "cpu")
        assert (config.use_dot, config.block_n, config.block_k, config.num_warps) == tuple(row[2:6])
        assert choose_config(4, n, k, 2, "cpu") == GC._choose_config(4, n, k, 2, 132, None, tuple(GC.CONFIGS), None,
                                                                     GC.PROGRAMS_PER_SM, GC.MIN_PROGRAM_BYTES,
                                                                     GC.MAX_SPLIT_K, GC.FMA_MAX_ACC)


def test_shipped_shape_rows_are_unique_and_well_formed():
    """One row per exact weight shape (a second row for the same (N, K) would be dead), each a valid launch."""
    shapes = [row[:2] for row in GC.SHAPE_CONFIGS]
    assert len(shapes) == len(set(shapes)), [s for s in shapes if shapes.count(s) > 1]
    for n, k, use_dot, block_n, block_k, warps, stages, split in GC.SHAPE_CONFIGS:
        config = choose_config(1, n, k, 2, "cpu")
        assert (config.use_dot, config.block_n, config.block_k, config.num_warps, config.num_stages) == (
            use_dot, block_n, block_k, warps, stages)
        assert split is None or 1 <= config.split_k <= split  # cut where a split would be empty
