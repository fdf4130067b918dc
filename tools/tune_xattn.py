"""xattn_bsa's resident prefill chunk on the GPU: the block-sparse kernel's loop variants against the dense kernel,
the estimate kernel's tile candidates, and where compute_prefill's time goes (CUDA only).

    python tools/tune_xattn.py [--context 131072 --chunk 8192 --threshold 0.9 --sections bsa,estimate,pieces]

One 8K-query chunk against 128K keys, random bf16 q/k/v at Qwen3-4B's attention shape. Times are medians of --reps
CUDA events.
  bsa:      the dense kernel (flash_attn_with_lse, causal), then block_sparse_attention under each loop variant
            (--loops: LoopConfig specs; "old" is the kernel before runs: lists at 3 stages) for selections of
            (query block, key block) pairs: every visible block (density 1.0), structured ones (sink, local band,
            vertical stripes of 4 blocks or of 1), a random one, and the policy's own on these q/k. Per row: ms,
            x dense, and x dense per tile (ms / (density * dense ms): 1.00 is the dense kernel's cost per kept
            tile), and the largest difference from the first variant's output.
  estimate: xattn_block_mass under each candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) of its SM90 tables,
            16-bit and fp8 (the fp8 times include quantize_strided of q and k), each with its difference from the
            16-bit default's mass, and how far the policy's selection moves when the estimate runs in fp8; then the
            default tiles with each LSB_ELEMENTS candidate (a long chunk's rows in fewer, longer slices).
  pieces:   XAttentionPolicy.compute_prefill's parts: estimate, threshold and vote, lists, block-sparse attention.
"""
from __future__ import annotations

import torch
from profile_sparse_prefill import (  # tools/ is on sys.path
    chunk_parser,
    dense_chunk_ms,
    random_chunk,
    timed,
)

from sparsekv.kernels import flash_attn_with_lse
from sparsekv.kernels._dispatch import attention_backend, default_kernels
from sparsekv.policies.xattn import strided_fp8 as fp8_module
from sparsekv.policies.xattn import xattn_estimate as est
from sparsekv.policies.xattn.block_lists import block_runs
from sparsekv.policies.xattn.block_sparse_attention import (
    block_lists_from_mask,
    block_sparse_attention,
    loop_config,
)
from sparsekv.policies.xattn import XAttentionPolicy

CANDIDATES = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3),
              (64, 128, 4, 4), (128, 256, 8, 2), (256, 128, 8, 2)]
FP8_CANDIDATES = [(128, 256, 8, 3), (128, 256, 8, 4), (256, 128, 8, 3), (256, 128, 8, 4), (128, 128, 8, 4),
                  (128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 8, 2)]
QUANTIZE_CANDIDATES = [(4096, 4), (8192, 4), (8192, 8), (16384, 8), (32768, 8)]  # (ROW_TILE_ELEMENTS, warps)
LSB_CANDIDATES = [1 << 25, 1 << 26, 1 << 27, 1 << 28]  # LSB_ELEMENTS: fewer, longer slices of a long chunk's rows
LOOPS = {"old": "mode=lists,list_stages=3", "lists": "mode=lists", "runs": "mode=runs", "auto": "mode=auto"}


def selections(policy: XAttentionPolicy, q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
    """keep [nqb, nkb] bool selections of the chunk's query blocks (causal; the diagonal always kept)."""
    keep, qb0 = policy.select_prefill_blocks(q, k)
    nqb, nkb = keep.shape
    qb = torch.arange(qb0, qb0 + nqb, device=q.device)[:, None]
    kb = torch.arange(nkb, device=q.device)[None, :]
    visible = kb <= qb
    band = (qb - kb) < 64  # the 64 blocks (8K keys) up to the diagonal
    gen = torch.Generator(device=q.device).manual_seed(0)
    return {
        "density 1.0": visible,
        "sink + band 64 + stripes 4/32": visible & ((kb == 0) | band | (kb % 32 < 4)),
        "sink + band 8 + stripes 1/6": visible & ((kb == 0) | ((qb - kb) < 8) | (kb % 6 == 0)),
        "random 0.2 + diagonal": visible & ((torch.rand(keep.shape, generator=gen, device=q.device) < 0.2)
                                            | (kb == qb)),
        f"policy threshold {policy.threshold}": keep,
    }


def bench_block_sparse(q, k, v, policy: XAttentionPolicy, loops: dict[str, str], reps: int) -> None:
    S, n, bs = k.shape[0], q.shape[0], policy.block_size
    scale = q.shape[2] ** -0.5
    dense_ms = timed(lambda: flash_attn_with_lse(q, k, v, scale, causal=True), reps)
    backend = attention_backend(default_kernels(q.device).attention, q.dtype, True, n, S, q.shape[2])
    print(f"dense kernel flash_attn_with_lse ({backend}, Sq={n}, Sk={S}, causal): {dense_ms:8.2f} ms")
    configs = {label: loop_config(spec) for label, spec in loops.items()}
    for name, keep in selections(policy, q, k).items():
        idx, count = block_lists_from_mask(keep)
        qb0 = (S - n) // bs
        runs = block_runs(idx, count, qb0)
        visible = sum(qb + 1 for qb in range(qb0, qb0 + keep.shape[0]))
        density = count.sum().item() / visible
        tiles = runs.n_full.sum().item()
        print(f"\n{name}: density {density:.3f}, {tiles / max(1, runs.n_runs.sum().item()):.1f} blocks per run "
              f"before the diagonal")
        first = None
        for label, loop in configs.items():
            def fn(idx=idx, count=count, loop=loop):
                return block_sparse_attention(q, k, v, idx, count, bs, scale, S - n, loop=loop)

            ms = timed(fn, reps)
            out = fn()[0]
            diff = 0.0 if first is None else (out.float() - first.float()).abs().max().item()
            first = out if first is None else first
            print(f"  {label:10s} {loop!s:58s} {ms:8.2f} ms  {ms / dense_ms:6.3f}x dense  "
                  f"{ms / (density * dense_ms):6.3f}x dense per tile  max diff {diff:.1e}")


def bench_estimate(q, k, policy: XAttentionPolicy, dense_ms: float, reps: int, fp8_only: bool = False) -> None:
    stride, bs = policy.stride, policy.block_size
    exact = est.xattn_block_mass(q, k, stride, bs, fp8=False)
    sweeps = ((False, est.GPU_CONFIG_16BIT_SM90, CANDIDATES), (True, est.GPU_CONFIG_FP8_SM90, FP8_CANDIDATES))
    for fp8, table, candidates in sweeps[1:] if fp8_only else sweeps:
        default = table[128]
        for config in candidates:
            table[128] = config
            label = f"xattn_block_mass {'fp8' if fp8 else '16-bit'} {str(config):18s}"
            try:
                ms = timed(lambda: est.xattn_block_mass(q, k, stride, bs, fp8=fp8), reps)
                mass = est.xattn_block_mass(q, k, stride, bs, fp8=fp8)
                err = ((mass - exact).norm() / exact.norm()).item()
                print(f"{label} {ms:7.2f} ms ({ms / dense_ms:.3f}x dense) rel diff {err:.1e}", flush=True)
            except Exception as exc:  # a configuration the compiler rejects (shared memory, ...)
                print(f"{label} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        table[128] = default
    default = est.LSB_ELEMENTS
    for elements in LSB_CANDIDATES:
        est.LSB_ELEMENTS = elements
        ms = timed(lambda: est.xattn_block_mass(q, k, stride, bs), reps)
        mass = est.xattn_block_mass(q, k, stride, bs)
        err = ((mass - exact).norm() / exact.norm()).item()
        lsb = q.shape[1] * (q.shape[0] // stride) * -(-k.shape[0] // bs)  # [H, rows, nkb] of the whole chunk
        print(f"xattn_block_mass at the default tiles, LSB_ELEMENTS {elements} (~{-(-lsb // elements)} slices) "
              f"{ms:7.2f} ms rel diff {err:.1e}", flush=True)
    est.LSB_ELEMENTS = default
    default = fp8_module.ROW_TILE_ELEMENTS, fp8_module.QUANTIZE_WARPS
    for elements, warps in QUANTIZE_CANDIDATES:
        fp8_module.ROW_TILE_ELEMENTS, fp8_module.QUANTIZE_WARPS = elements, warps
        ms = timed(lambda: (fp8_module.quantize_strided(q, stride, k.shape[0] - q.shape[0]),
                            fp8_module.quantize_strided(k, stride, 0)), reps)
        gb = (q.numel() + k.numel()) * (q.element_size() + 1) / 1e9  # read 16-bit, write fp8
        print(f"quantize_strided of q and k, {elements} elements / {warps} warps per program {ms:7.3f} ms "
              f"({gb / ms:.2f} TB/s)", flush=True)
    fp8_module.ROW_TILE_ELEMENTS, fp8_module.QUANTIZE_WARPS = default
    kept, resolve = {}, est.fp8_estimate_ok
    for fp8 in (False, True):
        est.fp8_estimate_ok = lambda _q, fp8=fp8: fp8
        kept[fp8], _ = policy.select_prefill_blocks(q, k)
    est.fp8_estimate_ok = resolve
    both = (kept[False] & kept[True]).sum().item()
    print(f"selection at threshold {policy.threshold}: 16-bit keeps {kept[False].sum().item()} blocks, fp8 "
          f"{kept[True].sum().item()}, both {both}")


def bench_pieces(q, k, v, policy: XAttentionPolicy, dense_ms: float, reps: int) -> None:
    S, n = k.shape[0], q.shape[0]
    scale = q.shape[2] ** -0.5
    keep, _ = policy.select_prefill_blocks(q, k)
    block_idx, block_count = block_lists_from_mask(keep)
    pieces = {
        "select_prefill_blocks (estimate + threshold + vote)": lambda: policy.select_prefill_blocks(q, k),
        "block_lists_from_mask": lambda: block_lists_from_mask(keep),
        "block_runs": lambda: block_runs(block_idx, block_count, (S - n) // policy.block_size),
        "block_sparse_attention": lambda: block_sparse_attention(q, k, v, block_idx, block_count, policy.block_size,
                                                                 scale, S - n),
        "compute_prefill (all of it)": lambda: policy.compute_prefill(q, k, v, 0, scale),
    }
    for label, fn in pieces.items():
        ms = timed(fn, reps)
        print(f"{label:52s} {ms:7.2f} ms ({ms / dense_ms:.3f}x dense)")
    print(f"density of the random-q/k selection at threshold {policy.threshold}: {policy.last_density:.3f}")


def main() -> None:
    parser = chunk_parser(__doc__)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--sections", default="bsa,estimate,pieces", help="comma-separated: bsa, estimate, pieces")
    parser.add_argument("--fp8-only", action="store_true", help="estimate: sweep the fp8 tiles only")
    parser.add_argument("--loops", nargs="*", default=None,
                        help="block-sparse loop variants, each label:spec or spec (a LoopConfig spec, "
                             "e.g. auto2:mode=auto,run_min_tiles=2); default: "
                             + " ".join(f"{label}:{spec}" for label, spec in LOOPS.items()))
    args = parser.parse_args()
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - {"bsa", "estimate", "pieces"}
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from bsa, estimate, pieces")
    loops = LOOPS
    if args.loops:
        loops = {item.partition(":")[0] if ":" in item else item: item.partition(":")[2] if ":" in item else item
                 for item in args.loops}
    q, k, v = random_chunk(args.context, args.chunk)
    policy = XAttentionPolicy(threshold=args.threshold)
    if "bsa" in sections:
        bench_block_sparse(q, k, v, policy, loops, args.reps)
    if sections & {"estimate", "pieces"}:
        print()
        dense_ms = dense_chunk_ms(q, k, v, args.reps)
        if "estimate" in sections:
            bench_estimate(q, k, policy, dense_ms, args.reps, args.fp8_only)
        if "pieces" in sections:
            bench_pieces(q, k, v, policy, dense_ms, args.reps)


if __name__ == "__main__":
    main()
