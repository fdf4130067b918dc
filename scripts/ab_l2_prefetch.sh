#!/usr/bin/env bash
# A/B of SPARSEKV_L2_PREFETCH (PDL decode kernels prefetch into L2 before their wait: GEMV weight tiles, paged
# attention's older K/V) on the GPU: Qwen3-4B dummy weights, offload=none graph=cudagraph, 4K context, 64 decode
# steps, alternating on/off rows at batch 1 (twice) and batch 8; decode ms/token and the floor of each row.
#
#     bash scripts/ab_l2_prefetch.sh [OUT_DIR]        (default /tmp/ab_l2_prefetch)
set -uo pipefail
out=${1:-/tmp/ab_l2_prefetch}
mkdir -p "$out"
common=(model=qwen3_4b model.load_format=dummy offload=none graph=cudagraph bench.context=4096 bench.decode_steps=64)
for batch in 1 1 8; do
  for prefetch in 1 0; do
    echo "=== batch $batch SPARSEKV_L2_PREFETCH=$prefetch"
    SPARSEKV_L2_PREFETCH=$prefetch timeout 120 python3 -m sparsekv task=bench "${common[@]}" bench.batch_size=$batch \
      scheduler.max_num_seqs=32 hydra.run.dir="$out/run-b$batch-p$prefetch" 2>&1 | grep -E "decode|floor|rror" || true
  done
done
