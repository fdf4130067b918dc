"""Time MInference's kernels under candidate tile configurations (CUDA only), one 8K-query chunk against 128K keys.

    python tools/tune_vertical_slash.py [--context 131072 --chunk 8192] [--only estimate]
    python tools/tune_vertical_slash.py --head-dim 64 [--fp32]      # another entry of the tile tables
    python tools/tune_vertical_slash.py --prefill [--context 131072] [--configs 64,32,4,2 64,32,4,3]
    python tools/tune_vertical_slash.py --parts [--context 131072]

vertical_slash_attention: (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates on three selections of the default
budget (1000 columns, 6096 diagonals): the nearest 6096 offsets ("band"), a scattered one shaped like the
estimate on structured dummy weights (the nearest 3000 offsets plus 16-offset clusters further out), and 96 whole
64-offset bands (bands 0-1 and 94 random ones, what slash_granularity=64 picks when the mass is spread). Each
configuration's output is checked against the default configuration's; --head-dim 64 or 256 and --fp32 sweep the
entry of GPU_CONFIG_16BIT or GPU_CONFIG_FP32 for that head dim and skip the estimate; --fp32 sweeps FP32_CANDIDATES,
smaller tiles, since 4-byte tiles take twice the registers and shared memory. Estimate (--only estimate
skips the kernel sweep): vertical_slash_masses under BLOCK_K and keys-per-split candidates; the column top-1000 by
torch.topk and by top_indices; estimate_pattern and compute_prefill at slash_granularity 1 and 64. Prints one line
per candidate (median of --reps CUDA-event timings).

--parts: the kernel on the whole prompt (--chunk ignored: Sq = Sk = --context) with a selection shaped like the
defaults (250 columns with 4 sinks, 24 whole 64-offset bands with the 2 recent ones): all of it, with the pair count,
the diagonals only, the columns only and nothing (what every program pays), at the current tile configuration.

--prefill: what a user gets instead of one chunk in isolation. The engine prefills a --context-token prompt in one
step (policy=minference at its defaults, Qwen3-4B dims, structured dummy weights) under each candidate (or each
of --configs), in two rounds (the first compiles), and prints the prefill seconds and whether the greedy tokens
equal the first candidate's.
"""
from __future__ import annotations

import math
import torch

from sparsekv.policies.minference import vertical_slash as vs
from sparsekv.policies.minference import vertical_slash_estimate as est
from sparsekv.policies.minference.policy import SLASH_BAND, MInferencePolicy, band_offsets, top_indices
from profile_sparse_prefill import chunk_parser, dense_chunk_ms, random_chunk, timed  # tools/ is on sys.path

CANDIDATES = [(64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 16, 4, 2),
              (32, 32, 2, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 128, 8, 2)]
# fp32: the 16-bit list's deeper and wider tiles run 8-12x slower (4K x 32K, head dim 128, band selection: (64, 32, 4,
# 3) 482 ms and (64, 64, 4, 2) 720 ms against 58.7 for (64, 32, 4, 2)), so its sweep stays at one or two stages and
# 16-32 keys
FP32_CANDIDATES = [(64, 32, 4, 2), (64, 32, 4, 1), (64, 16, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2), (32, 32, 2, 2),
                   (32, 16, 4, 1), (32, 16, 2, 2), (16, 16, 2, 1)]


def selections(H: int, S: int, dev) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    vertical = torch.cat([torch.arange(30).expand(H, -1), 30 + torch.stack(
        [torch.randperm(S - 30, generator=gen)[:970] for _ in range(H)])], 1).sort(1).values
    band = torch.arange(6096)[None].expand(H, -1)
    rows = []
    for _ in range(H):
        starts = 3000 + torch.randperm((S - 3100) // 16, generator=gen)[:193] * 16
        far = (starts[:, None] + torch.arange(16)[None]).flatten()
        rows.append(torch.cat([torch.arange(3000), far[:3096]]).sort().values)
    scattered = torch.stack(rows)
    bands = torch.stack([torch.cat([torch.arange(2), 2 + torch.randperm(S // SLASH_BAND - 2, generator=gen)[:94]])
                         for _ in range(H)]).sort(1).values
    as_idx = lambda x: x.to(dev, torch.int32).contiguous()  # noqa: E731
    return {"band": (as_idx(vertical), as_idx(band)), "scattered": (as_idx(vertical), as_idx(scattered)),
            "96 bands": (as_idx(vertical), band_offsets(bands.to(dev), SLASH_BAND))}


def estimate_timings(q, k, v, S: int, n: int, dense_ms: float, reps: int) -> None:
    scale = q.shape[2] ** -0.5
    L = 64
    ref_col, ref_diag = est.vertical_slash_masses(q[-L:], k, scale)
    default = est.GPU_BLOCK_K, est.KEYS_PER_SPLIT
    for block_k in (64, 128):
        for per_split in (2048, 4096, 8192):
            est.GPU_BLOCK_K, est.KEYS_PER_SPLIT = block_k, per_split
            ms = timed(lambda: est.vertical_slash_masses(q[-L:], k, scale), reps)
            col, diag = est.vertical_slash_masses(q[-L:], k, scale)
            err = max(((col - ref_col).norm() / ref_col.norm()).item(),
                      ((diag - ref_diag).norm() / ref_diag.norm()).item())
            print(f"vertical_slash_masses BLOCK_K={block_k:4d} keys/split={per_split:5d}: {ms:6.2f} ms "
                  f"rel diff {err:.1e}")
    est.GPU_BLOCK_K, est.KEYS_PER_SPLIT = default
    lse = est.last_rows_lse(q[-L:], k, scale, S - L)
    ms = timed(lambda: est.vertical_slash_masses(q[-L:], k, scale, lse=lse), reps)
    print(f"vertical_slash_masses with a given lse (offload=cpu's per-group call): {ms:6.2f} ms")
    ms = timed(lambda: est.last_rows_lse(q[-L:], k, scale, S - L), reps)
    print(f"last_rows_lse (the row-statistics pass alone): {ms:6.2f} ms")
    for k_top in (1000,):
        plain = timed(lambda: torch.topk(ref_col, k_top, dim=1).indices.sort(dim=1), reps)
        pruned = timed(lambda: top_indices(ref_col, k_top).sort(dim=1), reps)
        print(f"column top-{k_top} + sort of [{q.shape[1]}, {S}]: torch.topk {plain:.3f} ms, "
              f"top_indices {pruned:.3f} ms")
    topk = timed(lambda: torch.topk(ref_diag, 6096, dim=1).indices.sort(dim=1), reps)
    print(f"diagonal top-6096 + sort of [{q.shape[1]}, {S}]: {topk:.2f} ms; log2(S)={math.log2(S):.0f}")
    for granularity in (1, SLASH_BAND):
        policy = MInferencePolicy(slash_granularity=granularity)
        est_ms = timed(lambda: policy.estimate_pattern(q, k, scale), reps)
        vidx, soff = policy.estimate_pattern(q, k, scale)
        kern_ms = timed(lambda: vs.vertical_slash_attention(q, k, v, vidx, soff, scale, S - n), reps)
        total = timed(lambda: policy.compute_prefill(q, k, v, 0, scale), reps)
        bands = torch.div(soff.long(), 64, rounding_mode="floor")
        touched = sum(torch.unique(bands[h]).numel() for h in range(q.shape[1])) / q.shape[1]
        print(f"slash_granularity={granularity:2d}: estimate_pattern {est_ms:6.2f} ms, "
              f"vertical_slash {kern_ms:6.2f} ms, "
              f"compute_prefill {total:6.2f} ms ({total / dense_ms:.2f}x dense, density {policy.last_density:.3f}); "
              f"{touched:.0f} 64-offset bands touched per head")


def part_timings(context: int, reps: int) -> None:
    H, S = 32, context
    q, k, v = random_chunk(S, S)
    gen = torch.Generator().manual_seed(0)
    vertical = torch.cat([torch.arange(4).expand(H, -1), 4 + torch.stack(
        [torch.randperm(S - 4, generator=gen)[:246] for _ in range(H)])], 1).sort(1).values.to(q.device, torch.int32)
    bands = torch.stack([torch.cat([torch.arange(2), 2 + torch.randperm(S // SLASH_BAND - 2, generator=gen)[:22]])
                         for _ in range(H)]).sort(1).values
    slash = band_offsets(bands.to(q.device), SLASH_BAND).to(torch.int32).contiguous()
    none = torch.full((H, 1), 1 << 30, dtype=torch.int32, device=q.device)
    pairs = torch.zeros(1, dtype=torch.int64, device=q.device)
    scale = q.shape[2] ** -0.5
    parts = (("all", vertical, slash, None), ("all, pair count", vertical, slash, pairs),
             ("diagonals only", none, slash, None), ("columns only", vertical, none, None),
             ("nothing", none, none, None))
    for label, columns, diagonals, counter in parts:
        ms = timed(lambda: vs.vertical_slash_attention(q, k, v, columns, diagonals, scale, 0, counter), reps)
        print(f"vertical_slash whole prompt {S}, {label:16s} {ms:7.2f} ms {vs.GPU_CONFIG_16BIT[128]}")


def prefill_timings(context: int, configs: list[tuple[int, int, int, int]]) -> None:
    from sparsekv import LLM, SamplingParams
    from sparsekv.tasks.bench.task import random_prompts

    engine = LLM(overrides=["model=qwen3_4b", "model.load_format=dummy_structured", "offload=none",
                            "policy=minference", f"scheduler.max_model_len={context + 8}"]).engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = random_prompts(1, context, engine.spec.vocab_size, 0)
    default, first = vs.GPU_CONFIG_16BIT[128], None
    for rnd in range(2):
        for config in configs:
            vs.GPU_CONFIG_16BIT[128] = config
            try:
                if rnd == 0:
                    engine.generate(prompt, params)  # compiles this configuration's kernels
                engine.reset_figures()
                tokens = engine.generate(prompt, params)[0].token_ids
                first = first or tokens
                print(f"prefill round {rnd} {str(config):18s} {engine.stats.prefill_seconds:7.3f} s "
                      f"tokens {'equal' if tokens == first else 'DIFFER'}", flush=True)
            except Exception as exc:  # a configuration the compiler rejects (shared memory, ...)
                print(f"prefill round {rnd} {str(config):18s} failed: {type(exc).__name__}: {str(exc)[:120]}")
    vs.GPU_CONFIG_16BIT[128] = default


def main() -> None:
    parser = chunk_parser(__doc__)
    parser.add_argument("--only", choices=["estimate"], default=None, help="skip the kernel tile sweep")
    parser.add_argument("--prefill", action="store_true", help="time the engine's whole-prompt prefill instead")
    parser.add_argument("--parts", action="store_true", help="time the kernel's parts on the whole prompt instead")
    parser.add_argument("--configs", nargs="+", default=None, metavar="M,N,WARPS,STAGES",
                        help="--prefill: these (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of every candidate")
    parser.add_argument("--head-dim", type=int, choices=sorted(vs.GPU_CONFIG_16BIT), default=128,
                        help="the tile sweep: q/k/v of this head dim (the tables' entry it chooses)")
    parser.add_argument("--fp32", action="store_true", help="the tile sweep: fp32 q/k/v (GPU_CONFIG_FP32)")
    args = parser.parse_args()
    if args.parts:
        part_timings(args.context, args.reps)
        return
    if args.prefill:
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else CANDIDATES
        prefill_timings(args.context, configs)
        return
    S, n = args.context, args.chunk
    q, k, v = random_chunk(S, n, args.head_dim, torch.float32 if args.fp32 else torch.bfloat16)
    scale = q.shape[2] ** -0.5
    dense_ms = dense_chunk_ms(q, k, v, args.reps)
    if args.head_dim == 128 and not args.fp32:
        estimate_timings(q, k, v, S, n, dense_ms, args.reps)
    if args.only == "estimate":
        return
    table = vs.GPU_CONFIG_FP32 if args.fp32 else vs.GPU_CONFIG_16BIT
    default = table[args.head_dim]
    print(f"tile sweep: {q.dtype}, head dim {args.head_dim}, current entry {default}")
    for label, (vertical, slash) in selections(q.shape[1], S, q.device).items():
        table[args.head_dim] = default
        ref, _ = vs.vertical_slash_attention(q, k, v, vertical, slash, scale, S - n)
        for config in FP32_CANDIDATES if args.fp32 else CANDIDATES:
            table[args.head_dim] = config
            try:
                ms = timed(lambda: vs.vertical_slash_attention(q, k, v, vertical, slash, scale, S - n), args.reps)
                out, _ = vs.vertical_slash_attention(q, k, v, vertical, slash, scale, S - n)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                print(f"vertical_slash {label:9s} {str(config):18s} {ms:7.2f} ms ({ms / dense_ms:.2f}x dense) "
                      f"rel diff {err:.1e}")
            except Exception as exc:  # a configuration the compiler rejects (shared memory, ...)
                print(f"vertical_slash {label:9s} {str(config):18s} failed: {type(exc).__name__}: {str(exc)[:120]}")
    table[args.head_dim] = default


if __name__ == "__main__":
    main()
