"""The fused elementwise kernels (sparsekv/kernels/rmsnorm.py, rotary.py, activation.py) against their pure-torch
references, the references against Hugging Face's modules, and a tiny model whose forward runs them.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by conftest); the end-to-end test
selects them as a user does, with SPARSEKV_ATTN_BACKEND=triton. The interpreter rounds fp32 -> bf16 toward zero
(GPUs round to nearest even), so CPU tests use fp32 (and fp16, which the interpreter rounds like torch); bf16 runs
in the GPU-marked tests.
"""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import _dispatch
from sparsekv.kernels import activation as activation_module
from sparsekv.kernels import rmsnorm as rmsnorm_module
from sparsekv.kernels import rotary as rotary_module
from sparsekv.kernels.activation import silu_and_mul, silu_and_mul_reference
from sparsekv.kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from sparsekv.kernels.rotary import apply_rotary, apply_rotary_reference, rotary_cos_sin_reference
from sparsekv.layers.rotary import rope_inv_freq
from tests.conftest import CountLaunches

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.gpu
TOL = 1e-5  # fp32 relative error


pytestmark = pytest.mark.usefixtures("triton_kernels")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(*shape, g, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _check(out: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert not out.isnan().any(), "an output element was never written (poisoned NaN)"
    assert _rel_err(out, ref) < tol, _rel_err(out, ref)


def _inv_freq(d: int, theta: float = 1e6, scaling=None) -> tuple[torch.Tensor, float]:
    inv_freq, attention_scaling = rope_inv_freq(d, theta, scaling)
    return inv_freq.to(DEV), attention_scaling


# ---------------------------------------------------------------------------------------------- rms norm
@pytest.mark.parametrize("shape", [(1, 64), (7, 37), (3, 5, 24), (4, 1), (2, 3000)])
def test_rms_norm_matches_reference(shape):
    g = _gen(sum(shape))
    x, w = _randn(*shape, g=g, scale=3.0), _randn(shape[-1], g=g)
    _check(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def test_rms_norm_strided_rows_and_two_pass(monkeypatch):
    g = _gen(1)
    wide = _randn(9, 80, g=g)
    x, w = wide[:, 3:53], _randn(50, g=g)  # rows 80 apart, last dim contiguous
    _check(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    monkeypatch.setattr(rmsnorm_module, "MAX_ONE_PASS", 16)  # rows longer than this: the chunked two-pass loop
    monkeypatch.setattr(rmsnorm_module, "CHUNK", 16)
    _check(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    r = _randn(9, 50, g=g)
    normed, residual = add_rms_norm(x, r, w, 1e-5)
    ref_normed, ref_residual = add_rms_norm_reference(x, r, w, 1e-5)
    _check(normed, ref_normed)
    assert torch.equal(residual, ref_residual)


@pytest.mark.parametrize("shape", [(1, 64), (6, 37), (2, 3, 16)])
def test_add_rms_norm_matches_reference(shape):
    g = _gen(len(shape) + shape[-1])
    x, r, w = _randn(*shape, g=g), _randn(*shape, g=g, scale=4.0), _randn(shape[-1], g=g)
    normed, residual = add_rms_norm(x, r, w, 1e-6)
    ref_normed, ref_residual = add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(residual, ref_residual)  # the residual stream is x + r, bit for bit
    _check(normed, ref_normed)
    assert residual.data_ptr() not in (x.data_ptr(), r.data_ptr())  # inputs untouched (graph buffers)


def test_rms_norm_weight_dtype_promotes_like_torch():
    g = _gen(2)
    x, w = _randn(5, 40, g=g), _randn(40, g=g, dtype=torch.float16)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == torch.float32
    _check(out, rms_norm_reference(x, w, 1e-6))


@pytest.mark.skipif(DEV.type == "cuda", reason="CPU interpreter check of the fp16 rounding order")
def test_fp16_rounding_order_matches_torch():
    """The interpreter rounds fp16 like torch: the kernels' cast points reproduce the references almost bitwise."""
    g = _gen(3)
    half = torch.float16
    x, r, w = _randn(16, 96, g=g, dtype=half), _randn(16, 96, g=g, dtype=half), _randn(96, g=g, dtype=half)
    normed, residual = add_rms_norm(x, r, w, 1e-6)
    ref_normed, ref_residual = add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(residual, ref_residual)
    assert (normed != ref_normed).float().mean() < 0.01 and _rel_err(normed, ref_normed) < 1e-3
    q, k = _randn(16, 4, 32, g=g, dtype=half), _randn(16, 2, 32, g=g, dtype=half)
    positions = torch.randint(0, 40000, (16,), generator=g).to(DEV)
    inv_freq, _ = _inv_freq(32)
    out = apply_rotary(q, k, positions, inv_freq, 1.0, w[:32], w[32:64], 1e-6)
    ref = apply_rotary_reference(q, k, positions, inv_freq, 1.0, w[:32], w[32:64], 1e-6)
    for o, rf in zip(out, ref):
        assert (o != rf).float().mean() < 0.01 and _rel_err(o, rf) < 1e-3
    gu = _randn(16, 2 * 80, g=g, dtype=half, scale=3.0)
    out, ref = silu_and_mul(gu), silu_and_mul_reference(gu)
    assert (out != ref).float().mean() < 0.01 and _rel_err(out, ref) < 1e-3


# ---------------------------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("n, h, kvh, d", [(5, 4, 2, 16), (3, 6, 1, 8), (4, 4, 4, 32), (1, 8, 2, 64), (7, 6, 3, 12)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_apply_rotary_matches_reference(n, h, kvh, d, qk_norm):
    g = _gen(n * 100 + h * 10 + d + qk_norm)
    qkv = _randn(n, (h + 2 * kvh) * d, g=g, scale=2.0)  # the model's q/k: strided views of one projection
    q = qkv[:, :h * d].view(n, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(n, kvh, d)
    positions = torch.randint(0, 200_000, (2 * n,), generator=g).to(DEV)[::2]  # arbitrary, non-contiguous
    inv_freq, _ = _inv_freq(d)
    qw, kw = (_randn(d, g=g), _randn(d, g=g)) if qk_norm else (None, None)
    out = apply_rotary(q, k, positions, inv_freq, 0.8, qw, kw, 1e-6)
    ref = apply_rotary_reference(q, k, positions, inv_freq, 0.8, qw, kw, 1e-6)
    for o, r in zip(out, ref):
        _check(o, r)
        assert o.is_contiguous()


def test_apply_rotary_llama3_scaling_int32_positions_and_q_norm_only():
    g = _gen(4)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    inv_freq, attention_scaling = _inv_freq(16, 5e5, scaling)
    q, k = _randn(6, 4, 16, g=g), _randn(6, 2, 16, g=g)
    positions = torch.tensor([0, 5, 3, 1000, 7, 2], dtype=torch.int32, device=DEV)
    qw = _randn(16, g=g)
    out = apply_rotary(q, k, positions, inv_freq, attention_scaling, qw, None, 1e-6)
    ref = apply_rotary_reference(q, k, positions, inv_freq, attention_scaling, qw, None, 1e-6)
    for o, r in zip(out, ref):
        _check(o, r)


# ---------------------------------------------------------------------------------------------- silu * up
@pytest.mark.parametrize("shape", [(1, 2 * 64), (5, 2 * 37), (2, 3, 2 * 24), (3, 2 * 1500)])
def test_silu_and_mul_matches_reference(shape):
    g = _gen(sum(shape))
    gu = _randn(*shape, g=g, scale=4.0)
    _check(silu_and_mul(gu), silu_and_mul_reference(gu))


def test_silu_and_mul_strided_rows():
    g = _gen(5)
    gu = _randn(6, 2 * 40 + 8, g=g, scale=4.0)[:, 8:]
    out = silu_and_mul(gu)
    _check(out, silu_and_mul_reference(gu))
    assert out.shape == (6, 40)


# ---------------------------------------------------------------------------------------------- checks
def test_bad_shapes_raise_value_errors_naming_the_shape():
    x = torch.zeros(3, 8, device=DEV)
    with pytest.raises(ValueError, match=r"\(3, 8\).*\(7,\)"):
        rms_norm(x, torch.ones(7, device=DEV), 1e-6)
    with pytest.raises(ValueError, match=r"\(3, 9\)"):
        add_rms_norm(x, torch.zeros(3, 9, device=DEV), torch.ones(8, device=DEV), 1e-6)
    with pytest.raises(ValueError, match=r"\(3, 7\)"):
        silu_and_mul(torch.zeros(3, 7, device=DEV))
    q, k, pos = torch.zeros(2, 4, 8, device=DEV), torch.zeros(2, 2, 8, device=DEV), torch.zeros(2, dtype=torch.long)
    inv_freq, _ = _inv_freq(8)
    with pytest.raises(ValueError, match=r"k \(2, 2, 6\)"):
        apply_rotary(q, torch.zeros(2, 2, 6, device=DEV), pos.to(DEV), inv_freq, 1.0)
    with pytest.raises(ValueError, match=r"positions \(3,\)"):
        apply_rotary(q, k, torch.zeros(3, dtype=torch.long, device=DEV), inv_freq, 1.0)
    with pytest.raises(ValueError, match=r"inv_freq \(3,\)"):
        apply_rotary(q, k, pos.to(DEV), inv_freq[:3], 1.0)
    with pytest.raises(ValueError, match=r"k_norm_weight \[D\] = \[8\]; got \(4,\)"):
        apply_rotary(q, k, pos.to(DEV), inv_freq, 1.0, torch.ones(8, device=DEV), torch.ones(4, device=DEV))


# ---------------------------------------------------------------------------------------------- references
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_reproduce_hf_bit_for_bit(dtype):
    """The torch path (the references) computes exactly what HF's Qwen3 norm and rotary compute."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    g = _gen(6)
    n, h, kvh, d = 9, 4, 2, 32
    x, w = torch.randn(n, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    hf_norm = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(w)
        assert torch.equal(rms_norm_reference(x, w, 1e-6), hf_norm(x))
    q, k = torch.randn(n, h, d, generator=g).to(dtype), torch.randn(n, kvh, d, generator=g).to(dtype)
    qw, kw = torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    positions = torch.randint(0, 100_000, (n,), generator=g)
    inv_freq, scaling = rope_inv_freq(d, 1e6, None)
    # HF: Qwen3RotaryEmbedding.forward's cos/sin, q_norm/k_norm per head, apply_rotary_pos_emb ([B, heads, S, D])
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    with torch.no_grad():
        q_norm, k_norm = Qwen3RMSNorm(d, eps=1e-6).to(dtype), Qwen3RMSNorm(d, eps=1e-6).to(dtype)
        q_norm.weight.copy_(qw)
        k_norm.weight.copy_(kw)
        hf_q, hf_k = apply_rotary_pos_emb(q_norm(q).transpose(0, 1)[None], k_norm(k).transpose(0, 1)[None],
                                          cos[None], sin[None])
    ref_q, ref_k = apply_rotary_reference(q, k, positions, inv_freq, scaling, qw, kw, 1e-6)
    assert torch.equal(ref_q, hf_q[0].transpose(0, 1)) and torch.equal(ref_k, hf_k[0].transpose(0, 1))
    assert all(torch.equal(a, b) for a, b in zip(rotary_cos_sin_reference(positions, inv_freq, scaling, dtype),
                                                 (cos, sin)))
    gate_up = torch.randn(n, 2 * 48, generator=g).to(dtype)
    assert torch.equal(silu_and_mul_reference(gate_up),
                       torch.nn.functional.silu(gate_up[:, :48]) * gate_up[:, 48:])


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("ckpt", ["qwen3_ckpt", "llama_ckpt"])
def test_model_forward_with_fused_kernels_matches_torch_path(ckpt, request, monkeypatch):
    """A prefill and two decode steps of a tiny model: the Triton path (every kernel, attention included;
    interpreted off-GPU) against the torch path, on the greedy tokens and the logits of the last step."""
    from sparsekv import LLM, SamplingParams
    from tests.conftest import random_prompt

    path = request.getfixturevalue(ckpt)
    prompt = random_prompt(6, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    overrides = [f"device={DEV.type}", "dtype=float32", "offload.block_size=16", "graph=eager"]
    launches = {}
    for module, name in ((rmsnorm_module, "_rms_norm_kernel"), (rotary_module, "_rotary_kernel"),
                         (activation_module, "_silu_and_mul_kernel")):
        launches[name] = CountLaunches(getattr(module, name))
        monkeypatch.setattr(module, name, launches[name])
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(_dispatch.ENV_BACKEND, backend)
        llm = LLM(str(path), overrides=overrides)
        for counter in launches.values():  # after the build: on CUDA it runs a warm-up request
            counter.calls = 0
        tokens = llm.generate([prompt], params)[0].token_ids
        results[backend] = tokens, llm.engine.runner.last_logits[0].clone()
        counts = {name: counter.calls for name, counter in launches.items()}
        # 3 layers x 3 steps: 2 norms (+ the final one) / 1 rotary / 1 silu per layer; none on the torch path. On
        # CUDA the one-row decode steps run the skinny GEMV, which computes silu * up in its loads, and decode fusion,
        # which runs every norm but the first layer's input norm with its residual add after the o or down
        # projection (kernels/linear_norm.py): silu in the prefill only, norms 7 + 1 per decode step.
        norms, silu = (21, 9) if DEV.type == "cpu" else (9, 3)
        assert counts == ({name: 0 for name in counts} if backend == "torch" else
                          {"_rms_norm_kernel": norms, "_rotary_kernel": 9, "_silu_and_mul_kernel": silu}), counts
    (torch_tokens, torch_logits), (triton_tokens, triton_logits) = results["torch"], results["triton"]
    assert triton_tokens == torch_tokens
    assert not triton_logits.isnan().any()
    atol = 1e-4 if DEV.type == "cpu" else 1e-2  # on GPU the Triton attention's fp32 tl.dot runs in tf32
    assert torch.allclose(triton_logits, torch_logits, atol=atol, rtol=0), (triton_logits - torch_logits).abs().max()


def test_emulated_segmented_graphs_with_fused_kernels_give_the_eager_tokens(qwen3_ckpt):
    """graph.mode=segmented passes the embed segment's Rope (static positions, no cos/sin tables on the Triton
    path) to every pre-attention segment; emulated off-GPU (a replay re-runs the captured function and copies its
    outputs into the first run's), the decode tokens equal eager decode's."""
    from sparsekv import LLM, SamplingParams
    from sparsekv.graphs.cuda_graph import attach_graph_runner
    from tests.conftest import random_prompt

    prompts = [random_prompt(5, seed=12)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    overrides = [f"device={DEV.type}", "dtype=float32", "offload.block_size=16", "graph=eager",
                 "graph.batch_sizes=[1]"]
    eager = LLM(str(qwen3_ckpt), overrides=overrides)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(str(qwen3_ckpt), overrides=overrides)
    attach_graph_runner(llm.engine, "segmented", llm.config.graph, emulate=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.runner.graph_runner.replayed_steps == params.max_tokens - 1


# ---------------------------------------------------------------------------------------------- GPU
@gpu
def test_bf16_kernels_match_references_on_gpu():
    """Qwen3-4B shapes in bf16; positions up to 128K check that in-kernel cos/sin stay accurate at large angles."""
    g = _gen(7)
    bf16, t = torch.bfloat16, 1000
    x, r, w = _randn(t, 2560, g=g, dtype=bf16), _randn(t, 2560, g=g, dtype=bf16), _randn(2560, g=g, dtype=bf16)
    _check(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), tol=5e-3)
    normed, residual = add_rms_norm(x, r, w, 1e-6)
    ref_normed, ref_residual = add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(residual, ref_residual)
    _check(normed, ref_normed, tol=5e-3)
    qkv = _randn(t, (32 + 16) * 128, g=g, dtype=bf16)
    q, k = qkv[:, :4096].view(t, 32, 128), qkv[:, 4096:5120].view(t, 8, 128)
    positions = torch.randint(0, 131072, (t,), generator=g).to(DEV)
    inv_freq, _ = _inv_freq(128)
    qw, kw = _randn(128, g=g, dtype=bf16), _randn(128, g=g, dtype=bf16)
    for weights in ((None, None), (qw, kw)):
        out = apply_rotary(q, k, positions, inv_freq, 1.0, *weights, 1e-6)
        ref = apply_rotary_reference(q, k, positions, inv_freq, 1.0, *weights, 1e-6)
        for o, rf in zip(out, ref):
            _check(o, rf, tol=5e-3)
    gu = _randn(t, 2 * 9728, g=g, dtype=bf16, scale=3.0)
    _check(silu_and_mul(gu), silu_and_mul_reference(gu), tol=5e-3)


@gpu
def test_float32_rotary_is_exact_at_large_angles_on_gpu():
    """float32 cos/sin agree with torch's to float32 rounding at angles up to 1e6 radians (positions of a 1M-token
    context): the GPU's approximate sin/cos, unreduced, are off by ~1e-5 already at a few hundred radians, which
    flips greedy tokens against HF in float32."""
    g = _gen(9)
    t = 512
    q, k = _randn(t, 4, 128, g=g), _randn(t, 2, 128, g=g)
    positions = torch.cat([torch.arange(0, 256), torch.randint(256, 1_000_000, (t - 256,), generator=g)]).to(DEV)
    inv_freq, _ = _inv_freq(128)
    out = apply_rotary(q, k, positions, inv_freq, 1.0)
    ref = apply_rotary_reference(q, k, positions, inv_freq, 1.0)
    for o, r in zip(out, ref):
        assert (o - r).abs().max().item() < 2e-5 * r.abs().max().item()
        _check(o, r, tol=2e-6)


@gpu
def test_kernels_replay_inside_a_cuda_graph():
    """Capture-safe: captured once, replayed on new inputs written into the same buffers, equal to eager."""
    g = _gen(8)
    bf16 = torch.bfloat16
    x, r, w = _randn(4, 2560, g=g, dtype=bf16), _randn(4, 2560, g=g, dtype=bf16), _randn(2560, g=g, dtype=bf16)
    q, k = _randn(4, 32, 128, g=g, dtype=bf16), _randn(4, 8, 128, g=g, dtype=bf16)
    gu = _randn(4, 2 * 9728, g=g, dtype=bf16)
    positions = torch.arange(4, device=DEV)
    inv_freq, _ = _inv_freq(128)

    def step():
        return (*add_rms_norm(x, r, w, 1e-6), rms_norm(x, w, 1e-6),
                *apply_rotary(q, k, positions, inv_freq, 1.0, w[:128], w[128:256], 1e-6), silu_and_mul(gu))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (x, r, q, k, gu):
        t.copy_(torch.randn(t.shape, generator=g).to(DEV, bf16))
    positions.copy_(torch.tensor([70000, 3, 129000, 8]))
    graph.replay()
    torch.cuda.synchronize()
    for o, e in zip(outs, step()):
        assert torch.equal(o, e)
