"""Where a sparse prefill chunk's attention time goes (CUDA only), one layer, one chunk at the end of a long prompt.

    python tools/profile_sparse_prefill.py --context 131072 --chunk 8192

Times (CUDA events, median of --reps) the dense chunk attention (FullPolicy.compute_prefill) against MInference's
pattern estimate and its vertical-slash kernel, for two selections: the estimate on random q/k (near-uniform
attention: the top diagonals scatter) and a clustered one (the nearest `slash_size` offsets, the budget's
columns spread evenly), and xattn_bsa's block_mass estimate and its compute_prefill. Prints the tiles each
vertical-slash selection needs per query block (full and partial) beside the dense causal tile count.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from sparsekv.policies.minference.vertical_slash import vertical_slash_attention
from sparsekv.policies.minference.vertical_slash_estimate import vertical_slash_masses
from sparsekv.policies.full import FullAttentionPolicy as FullPolicy
from sparsekv.policies.minference import MInferencePolicy
from sparsekv.policies.xattn import XAttentionPolicy


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def chunk_parser(doc: str) -> argparse.ArgumentParser:
    """The options every sparse-prefill timing script takes: --context keys, --chunk queries, --reps."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    return parser


def random_chunk(context: int, chunk: int, head_dim: int = 128,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q [chunk, 32, head_dim] and k, v [context, 8, head_dim] on the GPU, seed 0 (Qwen3-4B's attention shape
    at the defaults: bf16, head dim 128)."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    return (torch.randn(chunk, 32, head_dim, device=dev, dtype=dtype),
            torch.randn(context, 8, head_dim, device=dev, dtype=dtype),
            torch.randn(context, 8, head_dim, device=dev, dtype=dtype))


def dense_chunk_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reps: int) -> float:
    ms = timed(lambda: FullPolicy().compute_prefill(q, k, v, 0, q.shape[2] ** -0.5), reps)
    print(f"dense chunk attention (Sq={q.shape[0]}, Sk={k.shape[0]}): {ms:8.2f} ms")
    return ms


def main() -> None:
    parser = chunk_parser(__doc__)
    parser.add_argument("--structured-layer", type=int, default=None,
                        help="take q/k/v of this layer of Qwen3-4B with model.load_format=dummy_structured (a prefill "
                             "of --context random tokens) instead of random tensors")
    args = parser.parse_args()
    dev = torch.device("cuda")
    H, D, S, n = 32, 128, args.context, args.chunk
    scale = D ** -0.5
    if args.structured_layer is None:
        q, k, v = random_chunk(S, n)
    else:
        from sparsekv.llm import LLM
        from sparsekv.tasks.bench.task import random_prompts
        from sparsekv.tasks.quality import capture_qkv
        llm = LLM(overrides=["model=qwen3_4b", "model.load_format=dummy_structured", f"scheduler.max_model_len={S + 8}",
                             "graph=eager"])
        ids = random_prompts(1, S, llm.engine.spec.vocab_size, 0)[0]
        q_all, k_all, v_all, scale, _ = capture_qkv(llm, ids, [args.structured_layer])
        del llm
        torch.cuda.empty_cache()
        q, k, v = q_all[0, -n:].to(dev), k_all[0].to(dev), v_all[0].to(dev)
        print(f"q/k/v of layer {args.structured_layer} of Qwen3-4B with structured dummy weights, {S} tokens")
    source = "random q/k" if args.structured_layer is None else f"structured layer {args.structured_layer}"
    minf = MInferencePolicy()
    dense_ms = dense_chunk_ms(q, k, v, args.reps)

    estimate_ms = timed(lambda: minf.estimate_pattern(q, k, scale), args.reps)
    L = minf.last_q
    masses_ms = timed(lambda: vertical_slash_masses(q[-L:], k, scale), args.reps)
    print(f"minference estimate_pattern:             {estimate_ms:8.2f} ms (fused masses kernel {masses_ms:.2f} ms, "
          f"the rest is top-k and sort)")
    minf_ms = timed(lambda: minf.compute_prefill(q, k, v, 0, scale), args.reps)
    print(f"minference compute_prefill:              {minf_ms:8.2f} ms ({minf_ms / dense_ms:.2f}x dense, "
          f"density {minf.last_density:.3f})")
    vidx, soff = minf.estimate_pattern(q, k, scale)
    V, NS = minf.budgets(S)
    clustered_s = torch.arange(NS, device=dev, dtype=torch.int32)[None].expand(H, -1).contiguous()
    clustered_v = torch.linspace(0, S - 1, V, device=dev).to(torch.int32)[None].expand(H, -1).contiguous()
    for label, vi, so in (("estimated", vidx, soff), ("clustered band", clustered_v, clustered_s)):
        ms = timed(lambda: vertical_slash_attention(q, k, v, vi, so, scale, S - n), args.reps)
        bands = [torch.unique(torch.div(so[h].long(), 64, rounding_mode="floor")).numel() for h in range(H)]
        print(f"vertical_slash {label:24s}: {ms:8.2f} ms ({ms / dense_ms:.2f}x dense); heads touch "
              f"{min(bands)}-{max(bands)} (mean {sum(bands) / H:.0f}) of {S // 64} 64-offset bands")
        if label.startswith("estimated"):
            near = (so.long() < 8192).float().mean().item()
            print(f"  estimated offsets below 8192: {near:.2f} of the slash budget")
    xattn = XAttentionPolicy()
    mass_ms = timed(lambda: xattn.block_mass(q, k), args.reps)
    xattn_ms = timed(lambda: xattn.compute_prefill(q, k, v, 0, scale), args.reps)
    print(f"xattn block_mass: {mass_ms:8.2f} ms; xattn compute_prefill ({source}): {xattn_ms:8.2f} ms "
          f"(density {xattn.last_density:.3f})")


if __name__ == "__main__":
    main()
