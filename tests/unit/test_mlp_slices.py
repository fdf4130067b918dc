"""A prompt longer than MLP_SLICE_TOKENS goes through the MLP in slices (a whole-prompt prefill step of 1M tokens
would otherwise hold a [1M, 2 * intermediate] activation): same values as one call, and the KV sizing counts one
slice of MLP activations."""
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
        whole_normed, whole_stream = mlp.add_norm_forward(x, residual, norm)
        calls = []
        original = mlp.gate_up_proj.forward
        monkeypatch.setattr(mlp.gate_up_proj, "forward", lambda t: calls.append(t.shape[0]) or original(t))
        monkeypatch.setattr(llama, "MLP_SLICE_TOKENS", 4)
        sliced = mlp(x)
        sliced_normed, sliced_stream = mlp.add_norm_forward(x, residual, norm)
    assert calls == [4, 4, 3, 4, 4, 3]
    torch.testing.assert_close(sliced, whole)
    torch.testing.assert_close(sliced_normed, whole_normed)
    torch.testing.assert_close(sliced_stream, whole_stream)


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
