"""Zero-copy block gather (sparsekv/kernels/block_gather.py) against copy-engine H2D copies of the same blocks.

    python tools/bench_block_gather.py [--blocks 4 32] [--json FILE]

Qwen3-4B block layout (1024 tokens x 8 KV heads x 128 dims, bf16: 2 MiB per K or V block) in pinned slabs. For each
(chunk words, warps) setting of the gather kernel and each block count, prints GB/s of K+V moved, beside
cudaMemcpyAsync of the same blocks (one copy per block, as the ring loads them) and one contiguous copy (the
link's rate). CUDA only.
"""
from __future__ import annotations

import argparse
import json

import torch

from sparsekv.kernels import block_gather
from sparsekv.kvcache.host_pool import HostPool


def _time(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3  # seconds per call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    block_size, kvh, dim, pool_blocks = 1024, 8, 128, 96
    host = HostPool(1, pool_blocks, block_size, kvh, dim, torch.bfloat16, pin_memory=True, slab_bytes=1 << 27)
    host.ensure_capacity(pool_blocks)
    offsets = torch.tensor(block_gather.slab_word_offsets(host.k_slabs, host.v_slabs), dtype=torch.int64,
                           device=dev)
    block_bytes = 2 * block_size * kvh * dim * 2  # K + V
    rows = []
    for n in args.blocks:
        ids = torch.randperm(pool_blocks)[:n].to(dev)
        dst = torch.empty((2, n, block_size, kvh, dim), dtype=torch.bfloat16, device=dev)
        ids_host = ids.tolist()

        def copy_engine():
            for i, b in enumerate(ids_host):
                k, v = host.block(0, b)
                dst[0, i].copy_(k, non_blocking=True)
                dst[1, i].copy_(v, non_blocking=True)
        seconds = _time(copy_engine)
        rows.append({"blocks": n, "method": "cudaMemcpyAsync per block", "gbps": n * block_bytes / seconds / 1e9})
        flat = host.k_slabs[0].view(-1)[: n * block_bytes // 2]
        flat_dst = torch.empty_like(flat, device=dev)
        seconds = _time(lambda: flat_dst.copy_(flat, non_blocking=True))
        rows.append({"blocks": n, "method": "one contiguous copy", "gbps": n * block_bytes / seconds / 1e9})
        for chunk in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                block_gather.CHUNK_WORDS, block_gather.NUM_WARPS = chunk, warps
                seconds = _time(lambda: block_gather.gather_host_blocks(
                    dst, (host.k_slabs, host.v_slabs), offsets, ids, 0, 0))
                rows.append({"blocks": n, "method": f"gather chunk={chunk} warps={warps}",
                             "gbps": n * block_bytes / seconds / 1e9})
        block_gather.gather_host_blocks(dst, (host.k_slabs, host.v_slabs), offsets, ids, 0, 0)
        torch.cuda.synchronize()
        for i, b in enumerate(ids_host[:2]):
            assert torch.equal(dst[0, i].cpu(), host.block(0, b)[0]), "gather read the wrong block"
    for row in rows:
        print(f"{row['blocks']:4d} blocks  {row['method']:34s} {row['gbps']:7.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
