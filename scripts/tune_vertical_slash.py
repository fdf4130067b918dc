"""Time MInference's kernels under candidate tile configurations (CUDA only), one 8K-query chunk against 128K keys.

    python scripts/tune_vertical_slash.py [--context 131072 --chunk 8192]

vertical_slash_attention: (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates on two selections of the default
budget (1000 columns, 6096 diagonals): the nearest 6096 offsets ("band"), and a scattered one shaped like the
estimate on structured dummy weights (the nearest 3000 offsets plus 16-offset clusters further out). Each
configuration's output is checked against the default configuration's. vertical_slash_masses: BLOCK_N and keys
per row-statistics split. Prints one line per candidate (median of --reps CUDA-event timings).
"""
from __future__ import annotations

import math
import torch

from sparsekv.kernels import vertical_slash as vs
from sparsekv.kernels import vertical_slash_estimate as est
from profile_sparse_prefill import chunk_parser, dense_chunk_ms, random_chunk, timed  # scripts/ is on sys.path

CANDIDATES = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2),
              (128, 128, 8, 2), (64, 32, 4, 2)]


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
    as_idx = lambda x: x.to(dev, torch.int32).contiguous()  # noqa: E731
    return {"band": (as_idx(vertical), as_idx(band)), "scattered": (as_idx(vertical), as_idx(scattered))}


def main() -> None:
    parser = chunk_parser(__doc__)
    args = parser.parse_args()
    S, n = args.context, args.chunk
    q, k, v = random_chunk(S, n)
    scale = q.shape[2] ** -0.5
    dense_ms = dense_chunk_ms(q, k, v, args.reps)
    default = vs.GPU_CONFIG_16BIT[128]
    for label, (vertical, slash) in selections(q.shape[1], S, q.device).items():
        vs.GPU_CONFIG_16BIT[128] = default
        ref, _ = vs.vertical_slash_attention(q, k, v, vertical, slash, scale, S - n)
        for config in CANDIDATES:
            vs.GPU_CONFIG_16BIT[128] = config
            try:
                ms = timed(lambda: vs.vertical_slash_attention(q, k, v, vertical, slash, scale, S - n), args.reps)
                out, _ = vs.vertical_slash_attention(q, k, v, vertical, slash, scale, S - n)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                print(f"vertical_slash {label:9s} {str(config):18s} {ms:7.2f} ms ({ms / dense_ms:.2f}x dense) "
                      f"rel diff {err:.1e}")
            except Exception as exc:  # a configuration the compiler rejects (shared memory, ...)
                print(f"vertical_slash {label:9s} {str(config):18s} failed: {type(exc).__name__}: {str(exc)[:120]}")
    vs.GPU_CONFIG_16BIT[128] = default
    L = 64
    ref_col, ref_diag = est.vertical_slash_masses(q[-L:], k, scale)
    for block_n in (32, 64, 128):
        for per_split in (2048, 4096, 8192):
            est.GPU_BLOCK_N, est.KEYS_PER_SPLIT = block_n, per_split
            ms = timed(lambda: est.vertical_slash_masses(q[-L:], k, scale), args.reps)
            col, diag = est.vertical_slash_masses(q[-L:], k, scale)
            err = max(((col - ref_col).norm() / ref_col.norm()).item(), ((diag - ref_diag).norm() / ref_diag.norm()).item())
            print(f"vertical_slash_masses BLOCK_N={block_n:4d} keys/split={per_split:5d}: {ms:6.2f} ms rel diff {err:.1e}")
    topk = timed(lambda: torch.topk(ref_diag, 6096, dim=1).indices.sort(dim=1), args.reps)
    print(f"top-6096 + sort of [{q.shape[1]}, {S}]: {topk:.2f} ms; log2(S)={math.log2(S):.0f}")


if __name__ == "__main__":
    main()
