"""Where xattn_bsa's resident prefill chunk goes, and the estimate kernel's tile candidates (CUDA only).

    python scripts/tune_xattn.py [--context 131072 --chunk 8192 --threshold 0.9]

One 8K-query chunk against 128K keys, random bf16 q/k/v at Qwen3-4B's attention shape. Times (median of --reps CUDA
events): dense attention, the estimate (xattn_block_mass) under each candidate (BLOCK_M, BLOCK_N, num_warps,
num_stages) of its SM90 table, checked against the default configuration's output, and the pieces of
XAttentionPolicy.compute_prefill: estimate, threshold and vote, kept-block lists, block-sparse attention.
"""
from __future__ import annotations


from profile_sparse_prefill import chunk_parser, dense_chunk_ms, random_chunk, timed  # scripts/ is on sys.path
from sparsekv.kernels import xattn_estimate as est
from sparsekv.kernels.block_sparse_attention import block_lists_from_mask, block_sparse_attention
from sparsekv.policies.xattn_bsa import XAttentionPolicy

CANDIDATES = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3),
              (128, 128, 8, 4), (256, 64, 8, 3)]


def main() -> None:
    parser = chunk_parser(__doc__)
    parser.add_argument("--threshold", type=float, default=0.9)
    args = parser.parse_args()
    S, n = args.context, args.chunk
    q, k, v = random_chunk(S, n)
    scale = q.shape[2] ** -0.5
    dense_ms = dense_chunk_ms(q, k, v, args.reps)
    policy = XAttentionPolicy(threshold=args.threshold)
    default = est.GPU_CONFIG_16BIT_SM90[128]
    ref = policy.block_mass(q, k)
    for config in CANDIDATES:
        est.GPU_CONFIG_16BIT_SM90[128] = config
        try:
            ms = timed(lambda: policy.block_mass(q, k), args.reps)
            err = ((policy.block_mass(q, k) - ref).norm() / ref.norm()).item()
            print(f"xattn_block_mass {str(config):18s} {ms:7.2f} ms ({ms / dense_ms:.3f}x dense) rel diff {err:.1e}")
        except Exception as exc:  # a configuration the compiler rejects (shared memory, ...)
            print(f"xattn_block_mass {str(config):18s} failed: {type(exc).__name__}: {str(exc)[:120]}")
    est.GPU_CONFIG_16BIT_SM90[128] = default
    keep, _ = policy.select_prefill_blocks(q, k)
    block_idx, block_count = block_lists_from_mask(keep)
    pieces = {
        "select_prefill_blocks (estimate + threshold + vote)": lambda: policy.select_prefill_blocks(q, k),
        "block_lists_from_mask": lambda: block_lists_from_mask(keep),
        "block_sparse_attention": lambda: block_sparse_attention(q, k, v, block_idx, block_count, policy.block_size,
                                                                 scale, S - n),
        "compute_prefill (all of it)": lambda: policy.compute_prefill(q, k, v, 0, scale),
    }
    for label, fn in pieces.items():
        ms = timed(fn, args.reps)
        print(f"{label:52s} {ms:7.2f} ms ({ms / dense_ms:.3f}x dense)")
    print(f"density of the random-q/k selection at threshold {args.threshold}: {policy.last_density:.3f}")


if __name__ == "__main__":
    main()
