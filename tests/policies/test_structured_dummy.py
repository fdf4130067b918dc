"""model.load_format=dummy_structured: random weights whose attention decays with distance and has vertical
stripes, so adaptive sparse policies have structure to find (plain dummy weights give near-uniform attention)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsekv.llm import LLM
from sparsekv.models.structured_dummy import (PEAK_LOGITS, STRIPE_EVERY, init_structured_dummy, is_stripe_token,
                                              layer_peak_logits)
from sparsekv.sampling_params import SamplingParams
from sparsekv.tasks.quality import capture_qkv

VOCAB = 8192


def _llm(load_format: str, context: int, *extra: str) -> LLM:
    return LLM(overrides=["model=tiny", f"model.load_format={load_format}", "model.head_dim=128",
                          "model.hidden_size=256", f"model.vocab_size={VOCAB}", "model.num_hidden_layers=3",
                          f"model.max_position_embeddings={context + 16}", f"scheduler.max_model_len={context + 16}",
                          *extra])


def _prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _last_query_attention(load_format: str, arch: list[str], context: int = 2048):
    """Softmax of the last 64 queries of every layer over all keys -> ([L, H, 64, S], prompt)."""
    ids = _prompt(context)
    llm = _llm(load_format, context, f"offload.num_kv_blocks={context // 256 + 4}", *arch)
    q, k, _, scale, _ = capture_qkv(llm, ids)
    q, k = q[:, -64:].float(), k.float()  # [L, 64, H, D], [L, S, KVH, D]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("lqhd,lkhd->lhqk", q, k) * scale
    positions = torch.arange(context)
    scores = scores.masked_fill(positions[None, None, None, :] > positions[-64:, None], float("-inf"))
    return scores.softmax(-1), ids


def _mass_at(p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Per layer, mean mass of the last queries on keys at distance [lo, hi)."""
    S = p.shape[-1]
    distance = (torch.arange(S - 64, S)[:, None] - torch.arange(S)[None, :])
    return (p * ((distance >= lo) & (distance < hi))).sum(-1).mean(dim=(1, 2))


@pytest.mark.parametrize("arch", [[], ["model.architecture=LlamaForCausalLM"]], ids=["qwen3", "llama"])
def test_structured_weights_plant_local_decay_and_stripes(arch):
    plain, _ = _last_query_attention("dummy", arch)
    p, ids = _last_query_attention("dummy_structured", arch)
    # local: the nearest 128 keys (6% of them) hold much of the mass on structured weights, ~their share on plain
    assert (_mass_at(p, 0, 128) > 0.35).all() and (_mass_at(plain, 0, 128) < 0.15).all()
    # the mass falls with distance, window by window of equal width
    near, mid, far = _mass_at(p, 128, 384), _mass_at(p, 512, 768), _mass_at(p, 1536, 1792)
    assert (near > mid).all() and (mid > far).all()
    # stripe tokens far away get far more weight per key than the other keys at the same distances
    S = p.shape[-1]
    stripe = is_stripe_token(torch.tensor(ids))
    far_keys = torch.arange(S) < S - 64 - 512
    assert (stripe & far_keys).sum() >= 1
    per_stripe = p[..., stripe & far_keys].mean(dim=(1, 2, 3))
    per_other = p[..., ~stripe & far_keys].mean(dim=(1, 2, 3))
    assert (per_stripe > 20 * per_other).all()


def test_xattn_keeps_fewer_blocks_on_structured_weights():
    """Offloaded xattn_bsa prefill: every prefix block on plain dummy weights, a subset on structured ones (at a
    threshold of 0.8: on plain dummy weights a lower one drops a few blocks of their flat attention too)."""
    context, density = 8192, {}
    for load_format in ("dummy", "dummy_structured"):
        llm = _llm(load_format, context, "policy=xattn_bsa", "policy.threshold=0.8", "offload=cpu",
                   "offload.prefill_chunk_size=2048")
        llm.engine.policy.reset_density()
        llm.generate([_prompt(context)], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        density[load_format] = llm.engine.policy.mean_density
    assert density["dummy"] > 0.95 and density["dummy_structured"] < 0.85


def test_peak_logits_spread_over_layers():
    peaks = layer_peak_logits(36)
    assert sorted(peaks) == pytest.approx([PEAK_LOGITS[0] + (PEAK_LOGITS[1] - PEAK_LOGITS[0]) * i / 35
                                          for i in range(36)])
    assert peaks == layer_peak_logits(36) and peaks[0] != peaks[1]
    assert layer_peak_logits(1) == [sum(PEAK_LOGITS) / 2]
    assert is_stripe_token(torch.tensor([0, 1, STRIPE_EVERY])).tolist() == [True, False, True]


def test_seeded_and_different_from_plain_dummy():
    a, b = _llm("dummy_structured", 256), _llm("dummy_structured", 256)
    plain = _llm("dummy", 256)
    wa, wb = a.engine.model.layers[0].self_attn.qkv_proj.weight, b.engine.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(wa, wb) and not torch.equal(wa, plain.engine.model.layers[0].self_attn.qkv_proj.weight)


def test_other_model_layouts_are_refused_with_the_fix():
    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="model.load_format=dummy"):
        init_structured_dummy(Other(), 0)
