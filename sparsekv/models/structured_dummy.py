"""Dummy weights with planted attention structure: `model.load_format=dummy_structured`.

Plain dummy weights (normal, std model.dummy_init_std) give near-uniform attention at every distance, so a policy
that adapts to the attention (xattn_bsa's mass threshold, MInference's top columns and diagonals) has nothing to
skip and a sparse benchmark on them measures only overhead. These weights have the same shapes, dtype and dense
work as the plain ones (GEMMs and dense attention time the same) but an attention pattern shaped like a
long-context model's:

* Power-law decay with distance. Every token's embedding shares one direction `c`. Each layer's q and k
  projections map `c` to one vector `u` per KV head with equal energy in every rotary frequency pair, so
  q_m . k_n ~ |q||k| mean_p cos((m - n) theta_p) ~ |q||k| (1 - ln(m - n) / ln(rope_theta)): a key's softmax
  weight falls as distance ** -(peak / ln(rope_theta)), `peak` being the logit at distance 0. Layers take
  peaks spread evenly over PEAK_LOGITS; with rope_theta 1e6 at 128K tokens the last query needs ~36% of the
  128-token blocks for 95% of its mass at the low end and ~11% at the high end (stripes included).
* Vertical stripes. Token ids divisible by STRIPE_EVERY (1 in 1024 of a random prompt) trade most of `c` for a
  second embedding direction `c2` (ratio 1 : STRIPE_KEY, same norm); keys map `c2` onto the two lowest-frequency
  rotary pairs, where every query has a component too (STRIPE_QUERY), so such keys gain a bonus that does not
  fade with distance (about a quarter of the last query's mass at 128K).
* Token-specific noise (NOISE) on top, and o_proj / down_proj scaled down by RESIDUAL_SCALE so that `c` stays
  the main component of the residual stream through every layer (random full-size outputs would swamp it).

Qwen3-style models (q/k RMSNorm) get the peak through the q_norm / k_norm weights, Llama-style ones through the
projection scale. The structure is a benchmark device, not a model of any checkpoint: report it beside results.
"""
from __future__ import annotations

import math

import torch
from torch import nn

PEAK_LOGITS = (16.0, 22.0)  # logit at distance 0, spread over the layers
STRIPE_EVERY = 1024  # token ids divisible by this are stripe (vertical-line) tokens
STRIPE_QUERY = 0.7  # share of the stripe direction in every query (relative to u)
STRIPE_KEY = 3.0  # share of the stripe direction in a stripe token's key (relative to u)
NOISE = 0.2  # token-specific part of q and k, relative to the structured part
EMBED_NOISE = 0.3  # per-element noise of the embeddings (the shared direction has per-element size 1)
RESIDUAL_SCALE = 1.0 / 64  # o_proj and down_proj std relative to model.dummy_init_std


def is_stripe_token(token_ids: torch.Tensor) -> torch.Tensor:
    return token_ids % STRIPE_EVERY == 0


def layer_peak_logits(num_layers: int) -> list[float]:
    """Each layer's peak logit: PEAK_LOGITS spread evenly, in an interleaved order so that neighbouring layers
    differ (deterministic)."""
    lo, hi = PEAK_LOGITS
    if num_layers == 1:
        return [(lo + hi) / 2]
    even = [lo + (hi - lo) * i / (num_layers - 1) for i in range(num_layers)]
    stride = next(s for s in (7, 5, 3, 1) if math.gcd(s, num_layers) == 1)
    return [even[(i * stride) % num_layers] for i in range(num_layers)]


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _check_model(model: nn.Module) -> None:
    layers = getattr(model, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers else None
    if attn is None or not hasattr(attn, "qkv_proj") or not hasattr(model, "embed_tokens"):
        raise ValueError(f"model.load_format=dummy_structured plants attention structure in Llama/Qwen3-family "
                         f"models (embed_tokens, layers[i].self_attn.qkv_proj); {type(model).__name__} has "
                         "another layout: use model.load_format=dummy")


@torch.no_grad()
def init_structured_dummy(model: nn.Module, seed: int) -> None:
    """Overwrite plain dummy weights (already drawn by init_dummy) with the planted structure above."""
    _check_model(model)
    spec = model.spec
    embed = model.embed_tokens.weight
    device = embed.device
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    d, D = spec.hidden_size, spec.head_dim
    H, KVH = spec.num_attention_heads, spec.num_key_value_heads
    pairs = D // 2
    if pairs < 3:
        raise ValueError(f"model.load_format=dummy_structured needs head_dim >= 6 (three rotary pairs); got {D}")

    # embeddings: shared direction c (per-element size 1), stripe tokens add c2; noise on top
    c_dirs = torch.linalg.qr(normal(d, 2)).Q.T  # [2, d] orthonormal
    c, c2 = c_dirs[0], c_dirs[1]
    # stripe tokens: c and c2 in the ratio 1 : STRIPE_KEY at the same norm, so that their keys (and queries) have
    # the size of the others' also without q/k norms
    rows = normal(*embed.shape) * EMBED_NOISE + c * math.sqrt(d)  # [vocab, d]
    stripe_rows = is_stripe_token(torch.arange(embed.shape[0], device=device))
    stripe_norm = math.sqrt(1 + STRIPE_KEY ** 2)
    rows[stripe_rows] += (c * (1 / stripe_norm - 1) + c2 * (STRIPE_KEY / stripe_norm)) * math.sqrt(d)
    c2_in_query = (stripe_norm - 1) / STRIPE_KEY  # a stripe token's query: (c + this c2) . x = c . x of the others
    embed.copy_(rows.to(embed.dtype))

    # u per KV head: equal energy in rotary pairs 0..P-3 (HF rotate-half layout: pair p = dims p, p + P), random
    # phases; z: the two lowest-frequency pairs
    qk_norm = getattr(model.layers[0].self_attn, "q_norm", None) is not None
    peaks = layer_peak_logits(len(model.layers))
    z = torch.zeros(D, device=device)
    z[[pairs - 2, pairs - 1]] = 1 / math.sqrt(2)
    for layer, peak in zip(model.layers, peaks):
        attn = layer.self_attn
        phase = torch.rand(KVH, pairs - 2, generator=gen, device=device) * (2 * math.pi)
        u = torch.zeros(KVH, D, device=device)
        u[:, :pairs - 2] = torch.cos(phase)
        u[:, pairs:2 * pairs - 2] = torch.sin(phase)
        u = _unit(u)  # [KVH, D]
        q_dir = _unit(u + STRIPE_QUERY * z).repeat_interleave(H // KVH, dim=0)  # [H, D]
        # |q| = |k| = sqrt(peak * sqrt(D)) at the structured part; Qwen3's q/k norms rescale to their weight
        size = math.sqrt(D) if qk_norm else math.sqrt(peak * math.sqrt(D))
        scale = size / math.sqrt(d)  # x = rmsnorm(h) has c . x ~ sqrt(d)
        w = attn.qkv_proj.weight  # [(H + 2 KVH) D, d]
        noise = NOISE * size / math.sqrt(D * d)  # per element of q/k: NOISE x the structured part's size
        q_rows = scale * q_dir.reshape(H * D, 1) * (c + c2_in_query * c2) + noise * normal(H * D, d)
        k_rows = scale * (u.reshape(KVH * D, 1) * c + z.repeat(KVH).reshape(KVH * D, 1) * c2) \
            + noise * normal(KVH * D, d)
        w[:H * D].copy_(q_rows.to(w.dtype))
        w[H * D:(H + KVH) * D].copy_(k_rows.to(w.dtype))
        if qk_norm:  # the peak logit q.k / sqrt(D) = gamma^2 sqrt(D) with unit-RMS q and k
            gamma = math.sqrt(peak / math.sqrt(D))
            attn.q_norm.weight.fill_(gamma)
            attn.k_norm.weight.fill_(gamma)
        attn.o_proj.weight.mul_(RESIDUAL_SCALE)
        layer.mlp.down_proj.weight.mul_(RESIDUAL_SCALE)
