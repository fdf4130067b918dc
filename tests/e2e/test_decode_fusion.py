"""Fewer kernels per decode layer: silu(gate) * up in the down projection's loads (kernels/gemv.py), the residual
add in the next RMSNorm (models/llama.py), the KV-cache write in the q/k norm + rotary kernel (kernels/rotary.py),
and programmatic dependent launch (PDL) of the small decode kernels.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by conftest; the `triton_kernels`
fixture's KernelChoice); every fused path is compared bit for bit with the unfused one it replaces (a KernelChoice
with decode_fusion=False). PDL is off off-GPU; the GPU-marked tests run it inside CUDA graphs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import sparsekv.factory
from sparsekv.kernels import _dispatch
from sparsekv.kernels import activation as activation_module
from sparsekv.kernels import gemv as G
from sparsekv.kernels import linear_norm as linear_norm_module
from sparsekv.kernels import rmsnorm as rmsnorm_module
from sparsekv.kernels.activation import silu_and_mul, silu_and_mul_reference
from sparsekv.kernels.backend import KernelChoice, resolve_kernels
from sparsekv.kernels.gemv import (
    GemvConfig,
    silu_mul_linear,
    silu_mul_linear_reference,
    skinny_linear,
)
from sparsekv.kernels.paged_attention import store_kv
from sparsekv.kernels.rotary import KVWrite, apply_rotary
from sparsekv.layers.linear import Linear
from sparsekv.layers.rotary import rope_inv_freq
from tests.conftest import CountLaunches, random_prompt

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.gpu

pytestmark = pytest.mark.usefixtures("triton_kernels", "one_thread")


def build_engines_with(monkeypatch, kernels: KernelChoice) -> None:
    """Engines built from here on get `kernels` instead of what resolve_kernels gives."""
    monkeypatch.setattr(sparsekv.factory, "resolve_kernels", lambda device: kernels)


def _gate_up(m: int, k: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(DEV, dtype)  # [M, 2K]
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, dtype)  # [N, K]
    return gate_up, w


# ---------------------------------------------------------------------------------------------- silu * up in the GEMV
PATHS = [("gemv", 1, GemvConfig(16, 16, 4, 1, 1, False, 1)), ("fma3d", 3, GemvConfig(16, 16, 4, 1, 1, False, 4)),
         ("dot", 5, GemvConfig(16, 16, 4, 2, 1, True, 16))]


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("path,m,config", PATHS, ids=[p for p, _, _ in PATHS])
def test_silu_mul_linear_equals_silu_and_mul_then_gemv(path, m, config, dtype, split):
    """K = 100 is ragged (tiles of 16), N = 50 too: the gated load gives the very x silu_and_mul writes, so the
    output equals the two-kernel path bit for bit, and the reference within rounding."""
    gate_up, w = _gate_up(m, 100, 50, dtype, seed=m + split)
    config = config._replace(split_k=split)
    fused = silu_mul_linear(gate_up, w, config=config)
    unfused = skinny_linear(silu_and_mul(gate_up), w, config=config)
    assert not fused.isnan().any()
    assert torch.equal(fused, unfused)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(fused.float(), silu_mul_linear_reference(gate_up, w).float(), atol=tol, rtol=tol)


def test_silu_mul_linear_bias_fallback_and_bad_inputs():
    gate_up, w = _gate_up(2, 48, 20, torch.float32, seed=1)
    b = torch.randn(20).to(DEV)
    torch.testing.assert_close(silu_mul_linear(gate_up, w, b), silu_mul_linear_reference(gate_up, w, b),
                               atol=1e-5, rtol=1e-5)
    many = gate_up.repeat(G.MAX_M, 1)  # beyond MAX_M rows: F.linear of the reference silu_and_mul
    assert torch.equal(silu_mul_linear(many, w), torch.nn.functional.linear(silu_and_mul_reference(many), w))
    with pytest.raises(ValueError, match="2K=96 but weight"):
        silu_mul_linear(gate_up, w[:, :40])
    with pytest.raises(ValueError, match=r"gate_up \[M, 2K\]"):
        silu_mul_linear(gate_up[None], w)


def test_linear_silu_mul_forward_follows_its_kernel_choice(triton_kernels, monkeypatch):
    """Linear.silu_mul_forward: one launch where the GEMV runs (gemv_max_rows here), the same values as
    self(silu_and_mul(.)); unfused with decode_fusion=False or where the GEMV does not run."""
    gemv = dataclasses.replace(triton_kernels, gemv_max_rows=G.MAX_M)
    torch.manual_seed(0)
    weight = torch.randn(24, 48, device=DEV)
    gate_up = torch.randn(1, 1, 96, device=DEV)
    counter = CountLaunches(G._skinny_linear_kernel)
    silu = CountLaunches(activation_module._silu_and_mul_kernel)
    monkeypatch.setattr(G, "_skinny_linear_kernel", counter)
    monkeypatch.setattr(activation_module, "_silu_and_mul_kernel", silu)
    outputs = []
    for kernels, launches in ((gemv, (1, 0)), (dataclasses.replace(gemv, decode_fusion=False), (2, 1)),
                              (dataclasses.replace(gemv, gemv_max_rows=0), (2, 2))):
        layer = Linear(48, 24, bias=False, kernels=kernels).to(DEV)
        layer.weight.data.copy_(weight)
        outputs.append(layer.silu_mul_forward(gate_up))
        assert (counter.calls, silu.calls) == launches and outputs[-1].shape == (1, 1, 24)
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[2], torch.nn.functional.linear(silu_and_mul(gate_up), weight))


# ---------------------------------------------------------------------------------------------- KV write in rotary
def _rotary_inputs(n: int, h: int, kvh: int, d: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (h + 2 * kvh) * d, generator=g).to(DEV, dtype)  # the fused projection's output
    q = qkv[:, :h * d].view(n, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(n, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(n, kvh, d)
    weights = (torch.randn(d, generator=g).to(DEV, dtype), torch.randn(d, generator=g).to(DEV, dtype))
    positions = torch.randint(0, 5000, (n,), generator=g).to(DEV)
    inv_freq = rope_inv_freq(d, 1e6, None)[0].to(DEV)
    return q, k, v, weights, positions, inv_freq


@pytest.mark.parametrize("n,h,kvh,d", [(3, 4, 2, 16), (2, 6, 3, 12)])
def test_rotary_kv_write_equals_store_kv(n, h, kvh, d):
    """The caches after apply_rotary(kv_write=...) equal store_kv of its outputs, bit for bit; q and k as without
    the write; untouched slots stay as they were. Padding rows share one scratch slot (CUDA-graph padding)."""
    q, k, v, (qw, kw), positions, inv_freq = _rotary_inputs(n, h, kvh, d, seed=n + d)
    blocks, block_size = 4, 4
    k_cache = torch.randn(blocks, block_size, kvh, d).to(DEV)  # [blocks, block_size, KVH, D]
    v_cache = torch.randn(blocks, block_size, kvh, d).to(DEV)
    slots = torch.tensor([5, 15, 15][:n], device=DEV)  # rows 1, 2: the scratch slot (the same k/v there below)
    if n == 3:
        q, k, v = q.clone(), k.clone(), v.clone()
        q[2], k[2], v[2], positions[2] = q[1], k[1], v[1], positions[1]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_plain, k_plain = apply_rotary(q, k, positions, inv_freq, 1.0, qw, kw, 1e-6)
    store_kv(k_plain, v.contiguous(), want_k, want_v, slots)
    q_out, k_out = apply_rotary(q, k, positions, inv_freq, 1.0, qw, kw, 1e-6,
                                kv_write=KVWrite(v, k_cache, v_cache, slots))
    assert torch.equal(q_out, q_plain) and torch.equal(k_out, k_plain)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_rotary_kv_write_bad_inputs():
    q, k, v, _, positions, inv_freq = _rotary_inputs(2, 4, 2, 16, seed=3)
    cache = torch.zeros(3, 4, 2, 16, device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    cases = [(KVWrite(v[:, :1], cache, cache.clone(), slots), "v like k"),
             (KVWrite(v, cache[..., :8], cache[..., :8].clone(), slots), r"caches \[..., KVH, D\]"),
             (KVWrite(v, cache, cache.clone(), slots[:1]), r"slot_mapping \[N\] = \[2\]"),
             (KVWrite(v, cache.double(), cache.double(), slots), "share a dtype")]
    for kv, match in cases:
        with pytest.raises(ValueError, match=match):
            apply_rotary(q, k, positions, inv_freq, 1.0, kv_write=kv)


# ---------------------------------------------------------------------------------------------- the model
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("ckpt", ["qwen3_ckpt", "llama_ckpt"])
def test_fused_model_forward_equals_unfused(ckpt, backend, request, triton_kernels, monkeypatch):
    """A prefill and three decode steps of a tiny model with decode_fusion on and off: the same tokens
    and bit-equal logits, on the torch path (HF's ops) and the Triton one (skinny GEMV forced). Fused on Triton:
    no silu_and_mul, no store_kv, and only the first layer's input norm as a norm launch: every other norm runs,
    with its residual add, in the launch after the o or down projection (kernels/linear_norm.py)."""
    from sparsekv import LLM, SamplingParams
    from sparsekv.kvcache import paged

    path = request.getfixturevalue(ckpt)
    monkeypatch.setenv(_dispatch.ENV_BACKEND, backend)  # the kernels the KV store calls
    fused_choice = (dataclasses.replace(triton_kernels, gemv_max_rows=G.MAX_M) if backend == "triton"
                    else KernelChoice.torch_reference())
    counters = {"norm": CountLaunches(rmsnorm_module._rms_norm_kernel),
                "silu": CountLaunches(activation_module._silu_and_mul_kernel),
                "linear_norm": CountLaunches(linear_norm_module._reduce_add_rms_norm_kernel)}
    monkeypatch.setattr(rmsnorm_module, "_rms_norm_kernel", counters["norm"])
    monkeypatch.setattr(activation_module, "_silu_and_mul_kernel", counters["silu"])
    monkeypatch.setattr(linear_norm_module, "_reduce_add_rms_norm_kernel", counters["linear_norm"])
    stores = []
    monkeypatch.setattr(paged, "store_kv", lambda *args: (stores.append(1), store_kv(*args)))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    overrides = [f"device={DEV.type}", "dtype=float32", "offload.block_size=16", "graph=eager"]
    results, launches = {}, {}
    for fusion in ("0", "1"):
        build_engines_with(monkeypatch, dataclasses.replace(fused_choice, decode_fusion=fused_choice.triton
                                                            and fusion == "1"))
        llm = LLM(str(path), overrides=overrides)
        for counter in counters.values():  # after the build: on CUDA it runs a warm-up request
            counter.calls = 0
        stores.clear()
        tokens = llm.generate([random_prompt(6, seed=21)], params)[0].token_ids
        results[fusion] = tokens, llm.engine.runner.last_logits[0].clone()
        launches[fusion] = {name: c.calls for name, c in counters.items()} | {"store_kv": len(stores)}
    assert results["1"][0] == results["0"][0]
    assert torch.equal(results["1"][1], results["0"][1])
    steps, layers = params.max_tokens, 3
    if backend == "triton":
        assert launches["0"] == {"norm": steps * (2 * layers + 1), "silu": steps * layers, "store_kv": steps * layers,
                                 "linear_norm": 0}
        assert launches["1"] == {"norm": steps, "silu": 0, "store_kv": 0, "linear_norm": steps * 2 * layers}
    else:
        assert launches["1"]["store_kv"] == launches["0"]["store_kv"] == steps * layers


# ---------------------------------------------------------------------------------------------- PDL
def test_pdl_is_off_off_gpu_and_needs_triton():
    assert not resolve_kernels("cpu", backend="triton").pdl
    assert not _dispatch.pdl_supported(torch.device("cpu"))
    assert _dispatch.pdl_launch_options(False) == {"USE_PDL": False}
    with pytest.raises(ValueError, match="need triton=True"):
        KernelChoice(attention="torch", triton=False, gemv_max_rows=0, decode_fusion=False, pdl=True)


def _decode_chain(x, r, norm_w, wqkv, wo, wgu, wdown, positions, inv_freq, kv_write, pdl: bool):
    """One decode layer's Triton kernels in their order, on static inputs -> every output."""
    normed = rmsnorm_module.rms_norm(x, norm_w, 1e-6, pdl=pdl)
    qkv = skinny_linear(normed, wqkv, pdl=pdl)  # [1, (32 + 16) * 128]
    q, k, v = qkv[:, :4096].view(1, 32, 128), qkv[:, 4096:5120].view(1, 8, 128), qkv[:, 5120:].view(1, 8, 128)
    q, k = apply_rotary(q, k, positions, inv_freq, 1.0, norm_w[:128], norm_w[128:256], 1e-6,
                        KVWrite(v, *kv_write), pdl=pdl)
    o = skinny_linear(q.reshape(1, 4096), wo, pdl=pdl)
    normed2, resid = rmsnorm_module.add_rms_norm(o, r, norm_w, 1e-6, pdl=pdl)
    gate_up = skinny_linear(normed2, wgu, pdl=pdl)
    down = silu_mul_linear(gate_up, wdown, pdl=pdl)  # split-K: + the reduction kernel
    final, resid2 = rmsnorm_module.add_rms_norm(down, resid, norm_w, 1e-6, pdl=pdl)
    return normed, q, k, o, normed2, resid, gate_up, down, final, resid2


@gpu
def test_gpu_pdl_chain_inside_a_cuda_graph_equals_eager_without_pdl():
    """Qwen3-4B decode shapes in bf16: the layer's kernels launched with PDL, eagerly and captured in a CUDA graph
    (replayed on new inputs), give bit-for-bit what they give without PDL, the KV cache writes included."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEV, bf16)

    x, r, norm_w = randn(1, 2560), randn(1, 2560), randn(2560)
    weights = (randn(6144, 2560, scale=2560 ** -0.5), randn(2560, 4096, scale=64 ** -1),
               randn(19456, 2560, scale=2560 ** -0.5), randn(2560, 9728, scale=9728 ** -0.5))
    positions = torch.tensor([3000], device=DEV)
    inv_freq = rope_inv_freq(128, 1e6, None)[0].to(DEV)
    caches = [torch.zeros(16, 16, 8, 128, device=DEV, dtype=bf16) for _ in range(2)]
    slots = torch.tensor([37], device=DEV)

    def run(pdl: bool = True):
        return _decode_chain(x, r, norm_w, *weights, positions, inv_freq, (*caches, slots), pdl)

    want = [t.clone() for t in run(pdl=False)] + [c.clone() for c in caches]
    assert _dispatch.pdl_supported(DEV) and resolve_kernels(DEV).pdl
    for c in caches:
        c.zero_()
    got = list(run()) + list(caches)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    stream = torch.cuda.Stream()  # warm up on a side stream, then capture with PDL edges
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for replay in range(3):
        x.copy_(randn(1, 2560))
        r.copy_(randn(1, 2560))
        positions.fill_(100 + replay)
        slots.fill_(5 + replay)
        for c in caches:
            c.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in captured] + [c.clone() for c in caches]
        for c in caches:
            c.zero_()
        for a, b in zip(got, list(run(pdl=False)) + list(caches)):
            assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_cudagraph_tokens_with_pdl_and_fusion_equal_eager_without(qwen3_ckpt, dtype, monkeypatch):
    """The tiny Qwen3 decoding with graph=cudagraph, PDL on and the fused layer: the tokens of eager decode with
    PDL and the decode fusions off (batches of 1 and of 3 padded to 4)."""
    from sparsekv import LLM, SamplingParams

    prompts = [[random_prompt(41, seed=5)], [random_prompt(n, seed=n) for n in (75, 33, 9)]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    overrides = ["device=cuda", f"dtype={dtype}", "offload.block_size=16"]
    monkeypatch.delenv(_dispatch.ENV_BACKEND, raising=False)
    default = resolve_kernels(DEV)
    with monkeypatch.context() as mp:
        build_engines_with(mp, dataclasses.replace(default, pdl=False, decode_fusion=False))
        eager = LLM(str(qwen3_ckpt), overrides=overrides + ["graph=eager"])
        want = [[o.token_ids for o in eager.generate(p, params)] for p in prompts]
        del eager
    llm = LLM(str(qwen3_ckpt), overrides=overrides + ["graph=cudagraph"])
    assert [[o.token_ids for o in llm.generate(p, params)] for p in prompts] == want
    assert llm.engine.runner.graph_runner.replayed_steps > 0
