"""A prompt longer than MLP_SLICE_TOKENS goes through the MLP in slices (a whole-prompt prefill step of 1M tokens
would otherwise hold a [1M, 2 * intermediate] activation): same values as one call, and the KV sizing counts one
slice of MLP activations. The GEMM path adds each product into the residual stream (Linear.add_into)."""
from __future__ import annotations

import torch

import sparsekv.models.llama as llama
from sparsekv.kernels.backend import resolve_kernels
from sparsekv.kvcache.sizing import prefill_activation_bytes
from sparsekv.layers.norm import RMSNorm
from sparsekv.models.spec import MLP_SLICE_TOKENS, ModelSpec

SPEC = ModelSpec(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                 rope_theta=1e6, rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False,
                 attention_bias=False, bos_token_id=None, eos_token_ids=[])


def _mlp_and_norm() -> tuple[llama.GatedMLP, RMSNorm]:
    torch.manual_seed(0)
    kernels = resolve_kernels("cpu")
    mlp = llama.GatedMLP(SPEC, kernels=kernels)
    norm = RMSNorm(SPEC.hidden_size, SPEC.rms_norm_eps, kernels=kernels)
    with torch.no_grad():
        for p in (*mlp.parameters(), norm.weight):
            p.normal_()
    # float64: a GEMM over fewer rows may block its sums differently; the comparison is about the slicing
    return mlp.double(), norm.double()


def test_sliced_mlp_equals_one_call(monkeypatch):
    mlp, norm = _mlp_and_norm()
    x = torch.randn(11, SPEC.hidden_size, dtype=torch.float64)  # [T, hidden]
    residual = torch.randn(11, SPEC.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        whole = mlp(x)
        want_normed, want_stream = norm(whole, residual)
        whole_residual = residual.clone()
        whole_normed, whole_stream = mlp.add_norm_forward(x, whole_residual, norm)
        calls = []
        original = mlp.gate_up_proj.forward
        monkeypatch.setattr(mlp.gate_up_proj, "forward", lambda t: calls.append(t.shape[0]) or original(t))
        monkeypatch.setattr(llama, "MLP_SLICE_TOKENS", 4)
        sliced = mlp(x)
        sliced_residual = residual.clone()
        sliced_normed, sliced_stream = mlp.add_norm_forward(x, sliced_residual, norm)
    assert calls == [4, 4, 3, 4, 4, 3]
    torch.testing.assert_close(sliced, whole)
    for normed, stream, written in ((whole_normed, whole_stream, whole_residual),
                                    (sliced_normed, sliced_stream, sliced_residual)):
        torch.testing.assert_close(normed, want_normed)
        torch.testing.assert_close(stream, want_stream)
        assert stream.data_ptr() == written.data_ptr()  # the GEMMs added into the caller's residual


def test_add_into_adds_in_the_gemm_or_falls_back():
    """Linear.add_into: residual += linear(x) (gated: of silu(gate) * up), through the GEMM's epilogue when it can,
    else by a separate add (bias, a strided residual); the same values either way."""
    torch.manual_seed(0)
    kernels = resolve_kernels("cpu")
    x = torch.randn(7, 12, dtype=torch.float64)
    for bias in (False, True):
        for gated in (False, True):
            linear = llama.Linear(6 if gated else 12, 5, bias=bias, kernels=kernels).double()
            with torch.no_grad():
                want = (linear.silu_mul_forward(x) if gated else linear(x)) + 1.0
                residual = torch.ones(7, 5, dtype=torch.float64)
                linear.add_into(x, residual, gated)
                torch.testing.assert_close(residual, want)
                strided = torch.ones(7, 10, dtype=torch.float64)[:, ::2]
                linear.add_into(x, strided, gated)
                torch.testing.assert_close(strided, want)


def test_add_norm_forward_writes_residual_only_when_allowed():
    torch.manual_seed(0)
    kernels = resolve_kernels("cpu")
    linear = llama.Linear(12, SPEC.hidden_size, bias=False, kernels=kernels).double()
    norm = RMSNorm(SPEC.hidden_size, SPEC.rms_norm_eps, kernels=kernels).double()
    x, residual = torch.randn(5, 12, dtype=torch.float64), torch.randn(5, SPEC.hidden_size, dtype=torch.float64)
    before = residual.clone()
    with torch.no_grad():
        want = norm(linear(x), residual)
        kept = linear.add_norm_forward(x, residual, norm)
        assert torch.equal(residual, before)
        written = linear.add_norm_forward(x, residual, norm, residual_in_place=True)
    assert written[1].data_ptr() == residual.data_ptr()
    for got in (kept, written):
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_activation_estimate_counts_one_mlp_slice():
    per_token = (8 * SPEC.hidden_size + 6 * SPEC.num_attention_heads * SPEC.head_dim) * 2
    mlp_slice = MLP_SLICE_TOKENS * 4 * SPEC.intermediate_size * 2
    tokens = 4 * MLP_SLICE_TOKENS
    assert prefill_activation_bytes(tokens, SPEC, torch.bfloat16) == tokens * per_token + mlp_slice
    assert prefill_activation_bytes(8, SPEC, torch.bfloat16) == 8 * (per_token + 4 * SPEC.intermediate_size * 2)


def test_linear_writes_into_out():
    torch.manual_seed(0)
    kernels = resolve_kernels("cpu")
    for bias in (False, True):
        linear = llama.Linear(6, 5, bias=bias, kernels=kernels).double()
        x = torch.randn(9, 6, dtype=torch.float64)
        buffer = torch.zeros(12, 5, dtype=torch.float64)
        with torch.no_grad():
            result = linear(x, out=buffer[2:11])
            assert result.data_ptr() == buffer[2:11].data_ptr()
            torch.testing.assert_close(buffer[2:11], linear(x))
        assert not buffer[:2].any() and not buffer[11:].any()
