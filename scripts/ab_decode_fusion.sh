#!/usr/bin/env bash
# A/B of the decode-step switches on the GPU: SPARSEKV_DECODE_FUSION (fused residual+norm, silu*up in the down
# GEMV, KV write in the rotary kernel; default 1) x SPARSEKV_PDL (programmatic dependent launch; default 0).
# Qwen3-4B dummy weights, offload=none graph=cudagraph, batch 1 at 4K context: one bench row per combination
# (decode ms/token), then a profile of the fastest-expected combination and of the baseline (kernel ms per step).
#
#     bash scripts/ab_decode_fusion.sh [OUT_DIR]        (default /tmp/ab_decode_fusion)
set -euo pipefail
out=${1:-/tmp/ab_decode_fusion}
mkdir -p "$out"
common=(model=qwen3_4b model.load_format=dummy offload=none graph=cudagraph bench.context=4096 bench.decode_steps=64)
for fusion in 0 1; do
  for pdl in 0 1; do
    echo "=== SPARSEKV_DECODE_FUSION=$fusion SPARSEKV_PDL=$pdl"
    SPARSEKV_DECODE_FUSION=$fusion SPARSEKV_PDL=$pdl python3 -m sparsekv task=bench "${common[@]}" 2>&1 \
      | grep -E "decode|floor|rror" || true
  done
done
for combo in "0 0" "1 1"; do
  set -- $combo
  echo "=== profile SPARSEKV_DECODE_FUSION=$1 SPARSEKV_PDL=$2"
  SPARSEKV_DECODE_FUSION=$1 SPARSEKV_PDL=$2 python3 scripts/profile_decode.py --name "fusion$1-pdl$2" \
    --context 4096 --out "$out" offload=none graph=cudagraph 2>&1 | head -40
done
