#!/usr/bin/env bash
# GPU host: environment report, GPU-marked tests, the issue benchmarks, a policy sweep with its report.
#
# Run from the repository root, after carrying the wheels sparsekv needs beyond torch/triton:
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#     OUT=/some/dir tools/gpu_bench.sh SECTION...      (sections: the case statement at the end)
# Each section below fits one 10-minute device call (H200, 2026-11-22 timings); a session's 30 minutes of device
# time hold about four calls:  1) info tests prefill   2) profile bench   3) graphs sweep_hf   4) sweep long.
# Everything is written under $OUT, packed so that at most 8 files come back:
#     info.log (nvidia-smi, versions, ceilings), gpu_tests.log, status.log (name, exit status, seconds per step),
#     bench_summary.md (Markdown table of every bench record), bench.tgz (each run's bench.json and run.log),
#     sweep-policies.tgz / sweep-full-hf.tgz (each sweep's job records, for the report built afterwards)
# A failing test or benchmark is logged and the script goes on; it exits 0 unless the environment is broken.
# Per-step limits (seconds), overridable: TEST_TIMEOUT (default 150), BENCH_TIMEOUT (default 100);
# DECODE_STEPS (default 16); BENCH_MODEL_ARGS (default "model=qwen3_4b model.load_format=dummy").
set -u
set -o pipefail
export PYTHONUNBUFFERED=1

: "${OUT:?set OUT to the folder the logs go to}"
mkdir -p "$OUT/bench"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-100}"
DECODE_STEPS="${DECODE_STEPS:-16}"

# sparsekv's pure-Python dependencies (hydra-core, omegaconf, antlr4, pluggy) come as wheels in .whl/
if ! python3 -c "import hydra, omegaconf, pluggy" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ;; esac

status() {  # status NAME RC SECONDS
    printf '%-28s rc=%-4s %6ss\n' "$1" "$2" "$3" | tee -a "$OUT/status.log"
}

section_info() {
    {
        echo "== date";          date -u
        echo "== host";          hostname; nproc; free -g
        echo "== nvidia-smi";    nvidia-smi
        echo "== nvidia-smi topology"; nvidia-smi topo -m 2>/dev/null
        echo "== versions"
        python3 - <<'EOF'
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("triton", "hydra", "omegaconf", "pluggy", "transformers", "flash_attn", "tqdm"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as err:  # noqa: BLE001
        print(name, "unavailable:", type(err).__name__, err)
import sparsekv, sparsekv.tasks
print("sparsekv", sparsekv.__file__, "tasks", sorted(sparsekv.tasks.TASKS))
EOF
        echo "== measured ceilings (python3 -m sparsekv.floors)"
        timeout 120 python3 -m sparsekv.floors
    } 2>&1 | tee "$OUT/info.log"
}

section_tests() {
    local start=$SECONDS rc
    timeout --kill-after=20 "$TEST_TIMEOUT" python3 -m pytest -q -m gpu tests/ ${TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
    rc=$?
    status "gpu tests" "$rc" "$((SECONDS - start))"
}

bench() {  # bench NAME [overrides...]: one task=bench run into $OUT/bench/NAME
    local name="$1"; shift
    local dir="$OUT/bench/$name" start=$SECONDS rc
    mkdir -p "$dir"
    echo "==== bench $name: $*"
    timeout --signal=INT --kill-after=30 "$BENCH_TIMEOUT" \
        python3 -m sparsekv task=bench bench.name="$name" "$@" \
            output_dir="$dir" hydra.run.dir="$dir/hydra" 2>&1 | tee "$dir/run.log"
    rc=$?
    status "bench $name" "$rc" "$((SECONDS - start))"
}

# BENCH_MODEL_ARGS swaps the model (e.g. "model=tiny device=cpu" for a dry run of this script on a laptop)
read -ra QWEN <<< "${BENCH_MODEL_ARGS:-model=qwen3_4b model.load_format=dummy}"
QWEN+=("bench.decode_steps=$DECODE_STEPS")

section_bench() {  # issues 2, 3, 4: most needed first, so a call cut short keeps what it finished (~6 min)
    bench none-8k          "${QWEN[@]}" offload=none bench.context=8192
    bench none-32k-hf      "${QWEN[@]}" offload=none bench.context=32768 bench.baseline=true
    bench cpu-32k          "${QWEN[@]}" offload=cpu bench.context=32768
    bench cpu-32k-chunk16k "${QWEN[@]}" offload=cpu offload.prefill_chunk_size=16384 bench.context=32768
    bench cpu-128k         "${QWEN[@]}" offload=cpu bench.context=131072
    bench none-128k        "${QWEN[@]}" offload=none bench.context=131072
    section_quest
    bench cpu-xattn-128k   "${QWEN[@]}" offload=cpu policy=xattn_bsa bench.context=131072
    bench none-minf-128k   "${QWEN[@]}" offload=none policy=minference bench.context=131072
    bench cpu-32k-4layer   "${QWEN[@]}" model.num_hidden_layers=4 offload=cpu bench.context=32768
    bench cpu-512k-4layer  "${QWEN[@]}" model.num_hidden_layers=4 offload=cpu bench.context=524288
}

section_kernels() {  # new kernels: GPU tests, decode-attention timings and tuning, prefill attention tuning (~5 min)
    timeout 150 python3 -m pytest -q -m gpu tests/test_decode_attention.py tests/test_quest_score.py \
        tests/test_attention_variants.py tests/test_kernels.py 2>&1 | tee "$OUT/kernel_tests.log" | tail -15
    timeout 150 python3 tools/bench_kernels.py --decode 2>&1 | tee "$OUT/decode_bench.log" | tail -60
    timeout 300 python3 tools/tune_attention.py --json "$OUT/tune_attention.json" > "$OUT/tune_attention.log" 2>&1
    tail -c 6000 "$OUT/tune_attention.log"
    rm -f "$OUT/tune_attention.compile.log"
}

section_offload() {  # issues 3 and 4 on one machine: full offloaded decode at 32K / 128K beside quest at 128K (~3 min)
    bench cpu-32k          "${QWEN[@]}" offload=cpu bench.context=32768
    bench cpu-128k         "${QWEN[@]}" offload=cpu bench.context=131072
    bench cpu-quest-128k   "${QWEN[@]}" offload=cpu policy=quest policy.token_budget=4096 policy.dense_layers=0 bench.context=131072
}

section_quest() {  # issue 4: quest decode at 128K, all layers selecting and with the default 2 dense layers
    bench cpu-quest-128k   "${QWEN[@]}" offload=cpu policy=quest policy.token_budget=4096 policy.dense_layers=0 bench.context=131072
    bench cpu-quest2-128k  "${QWEN[@]}" offload=cpu policy=quest policy.token_budget=4096 bench.context=131072
}

section_gather() {  # issue 4: the zero-copy block gather (tests, GB/s against copy engines) and a Quest step profile (~4 min)
    timeout 120 python3 -m pytest -q -m gpu tests/test_block_gather.py tests/test_policies.py 2>&1 | tail -5
    timeout 150 python3 tools/bench_block_gather.py --json "$OUT/bench/block_gather.json" 2>&1 | tail -40
    mkdir -p "$OUT/profile"
    timeout 150 python3 tools/profile_decode.py --name cpu-quest-32k --context 32768 --out "$OUT/profile" \
        offload=cpu policy=quest policy.token_budget=4096 policy.dense_layers=0 2>&1 | grep -v '^\s*$' | head -70
    tar czf "$OUT/profile.tgz" -C "$OUT" profile && rm -rf "$OUT/profile"
}

section_prefill() {  # issues 2 and 3: resident prefill by chunk budget, HF on the same GPU, offloaded prefill (~5 min)
    bench none-32k          "${QWEN[@]}" offload=none bench.context=32768 scheduler.max_num_batched_tokens=8192
    bench none-32k-c16k     "${QWEN[@]}" offload=none bench.context=32768 scheduler.max_num_batched_tokens=16384
    bench none-32k-1chunk-hf "${QWEN[@]}" offload=none bench.context=32768 scheduler.max_num_batched_tokens=32768 \
        bench.baseline=true
    bench cpu-32k           "${QWEN[@]}" offload=cpu bench.context=32768
    bench cpu-32k-chunk16k  "${QWEN[@]}" offload=cpu offload.prefill_chunk_size=16384 bench.context=32768
}

section_profile() {  # where decode steps spend their time: tools/profile_decode.py (~3 min)
    local dir="$OUT/profile" name
    mkdir -p "$dir"
    profile() { name="$1"; shift; timeout 150 python3 tools/profile_decode.py --name "$name" --out "$dir" "$@" \
        2>&1 | tee "$dir/$name.log" | grep -v '^\s*$' | head -70; }
    profile none-4k-graph --context 4096 offload=none graph=cudagraph
    profile none-4k-eager --context 4096 offload=none graph=eager
    profile cpu-quest-32k --context 32768 offload=cpu policy=quest policy.token_budget=4096 policy.dense_layers=0
    profile cpu-8k-segmented --context 8192 offload=cpu graph=segmented
    tar czf "$OUT/profile.tgz" -C "$OUT" profile && rm -rf "$dir"
}

section_long() {  # issue 3: the full 36-layer model at 512K (prefill ~3.5 min at ~400 TFLOP/s, 72 GiB pinned)
    BENCH_TIMEOUT=560 bench cpu-512k "${QWEN[@]}" offload=cpu bench.context=524288
}

section_longest() {  # issue 3: the longest prompt the default host pool holds, capped by what one 10-minute call can run
    local ctx
    ctx=$(python3 -c "
from sparsekv.kvcache.offload_store import host_pool_blocks
per_token = 36 * 8 * 128 * 2 * 2  # Qwen3-4B bf16 K+V bytes per token
pool_tokens = host_pool_blocks(None, 1024 * per_token) * 1024  # the default pool: 0.9 x available - 4 GiB
print(min(${LONGEST_CAP:-786432}, (pool_tokens - 16384) // 16384 * 16384))")
    echo "== longest: default host pool -> context $ctx" | tee -a "$OUT/status.log"
    BENCH_TIMEOUT="${BENCH_TIMEOUT_LONGEST:-575}" bench "cpu-longest-$ctx" "${QWEN[@]}" offload=cpu bench.context="$ctx"
}

section_graphs() {  # issue 5: CUDA-graph decode by batch size (GPU KV); eager, segmented and cudagraph offloaded
                   # at 8K and 32K, batch 1 and 4 (~5 min)
    for b in 1 8 32; do
        bench "none-4k-graph-b$b" "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096 bench.batch_size=$b scheduler.max_num_seqs=32
    done
    local mode ctx
    for ctx in 8k 32k; do
        for mode in eager segmented cudagraph; do
            bench "cpu-$ctx-$mode" "${QWEN[@]}" offload=cpu graph=$mode bench.context=$((${ctx%k} * 1024))
        done
    done
    for mode in eager segmented cudagraph; do
        bench "cpu-8k-$mode-b4" "${QWEN[@]}" offload=cpu graph=$mode bench.context=8192 bench.batch_size=4
    done
}

section_graph_micro() {  # per-segment capture choice and eager vs graph in one process (~2 min)
    timeout 120 python3 tools/bench_cuda_graph.py --json "$OUT/bench/cuda_graph.json" 2>&1 | tail -40
}

section_prefill_lite() {  # issue 2: resident prefill at the default chunk budget and in one chunk (~1 min)
    bench none-8k           "${QWEN[@]}" offload=none bench.context=8192
    bench none-32k-1chunk   "${QWEN[@]}" offload=none bench.context=32768 scheduler.max_num_batched_tokens=32768
}

sweep() {  # sweep NAME overrides...: one Hydra multirun of task=bench into $OUT/NAME, packed as $OUT/NAME.tgz
    local name="$1"; shift
    local dir="$OUT/$name" start=$SECONDS rc
    timeout --signal=INT --kill-after=30 "${SWEEP_TIMEOUT:-500}" python3 -m sparsekv -m task=bench "${QWEN[@]}" \
        bench.progress=false hydra.sweep.dir="$dir" "$@" 2>&1 | grep -v '^\s*$' | tail -80
    rc=$?
    status "$name" "$rc" "$((SECONDS - start))"
    tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "$dir"
}

# Issue 6: records for the committed report (build it here afterwards: unpack both archives into one folder and run
# `python -m sparsekv task=report report.dir=<folder> report.out_dir=docs/report`).
section_sweep() {     # the sparse policies, offloaded, 8K / 32K / 128K (~5 min)
    sweep sweep-policies offload=cpu policy=quest,xattn_bsa,minference bench.context=8192,32768,131072
}

section_report_sweeps() {  # issue 6 in one ~7-minute call: the three sweeps the committed report is built from
    SWEEP_TIMEOUT=200 sweep sweep-policies offload=cpu policy=quest,xattn_bsa bench.context=8192,32768,131072
    SWEEP_TIMEOUT=80 sweep sweep-minf offload=cpu policy=minference bench.context=8192,32768
    SWEEP_TIMEOUT=220 sweep sweep-full-hf offload=cpu policy=full bench.context=8192,32768,131072 bench.baseline=true
}

section_sweep_hf() {  # full attention with HF transformers beside it (GPU cache and offloaded cache) (~5 min)
    sweep sweep-full-hf offload=cpu policy=full bench.context=8192,32768,131072 bench.baseline=true
}

section_offload_graphs() {  # issues 4 and 5: offloaded decode captured per KV layout (graph=auto: cudagraph) beside
                           # segmented and eager, Quest at 128K against full attention (~8 min)
    timeout 200 python3 -m pytest -q -m gpu tests/test_cuda_graph.py tests/test_decode_attention.py tests/test_offload.py \
        tests/test_policies.py tests/test_block_gather.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
    bench cpu-quest-128k    "${QWEN[@]}" offload=cpu policy=quest policy.token_budget=4096 policy.dense_layers=0 bench.context=131072
    bench cpu-8k-cudagraph  "${QWEN[@]}" offload=cpu graph=cudagraph bench.context=8192
    bench cpu-128k          "${QWEN[@]}" offload=cpu bench.context=131072
    bench cpu-32k           "${QWEN[@]}" offload=cpu bench.context=32768
    bench cpu-quest2-128k   "${QWEN[@]}" offload=cpu policy=quest policy.token_budget=4096 bench.context=131072
    bench cpu-8k-segmented  "${QWEN[@]}" offload=cpu graph=segmented bench.context=8192
    bench cpu-8k-eager      "${QWEN[@]}" offload=cpu graph=eager bench.context=8192
}

section_segmented() {  # issue 5: segmented graphs with the attention captured per KV layout, beside cudagraph (~5 min)
    timeout 200 python3 -m pytest -q -m gpu tests/test_cuda_graph.py tests/test_offload.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
    local mode
    for mode in segmented cudagraph; do
        bench "cpu-8k-$mode"    "${QWEN[@]}" offload=cpu graph=$mode bench.context=8192
        bench "cpu-8k-$mode-b4" "${QWEN[@]}" offload=cpu graph=$mode bench.context=8192 bench.batch_size=4
        bench "cpu-quest-128k-$mode" "${QWEN[@]}" offload=cpu graph=$mode policy=quest policy.token_budget=4096 \
            policy.dense_layers=0 bench.context=131072
    done
}

section_decode_kernels() {  # issue 5: the GPU-resident 4K step's kernels: Triton GEMV against cuBLAS, paged-attention
                           # split plans at 4K, and the whole step with each GEMV (~6 min)
    timeout 240 python3 -m pytest -q -m gpu tests/test_gemv.py tests/test_cuda_graph.py tests/test_offload.py \
        tests/test_policies.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
    timeout 150 python3 tools/bench_kernels.py --gemv --quick 2>&1 | tee "$OUT/gemv_bench.log" | tail -45
    timeout 90 python3 -c "import sys; sys.path.insert(0, 'tools'); from bench_kernels import bench_paged_decode; bench_paged_decode((4096,))" \
        2>&1 | tee "$OUT/paged_bench.log" | tail -25
    bench none-4k-graph-b1 "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096
    SPARSEKV_GEMV=triton bench none-4k-graph-b1-gemv "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096
    SPARSEKV_GEMV=triton bench none-4k-graph-b8-gemv "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096 \
        bench.batch_size=8 scheduler.max_num_seqs=32
}

section_decode_resident() {  # issue 5: GPU-resident decode with the default GEMV choice, batch 1/8/32, and a profile
                            # of the batch-1 step; MInference/xattn prefill pieces timed apart (~5 min)
    timeout 120 python3 -m pytest -q -m gpu tests/test_gemv.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
    timeout 150 python3 tools/profile_sparse_prefill.py 2>&1 | tee "$OUT/sparse_prefill_profile.log"
    local b
    for b in 1 8 32; do
        bench "none-4k-graph-b$b" "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096 bench.batch_size=$b \
            scheduler.max_num_seqs=32
    done
    mkdir -p "$OUT/profile"
    timeout 150 python3 tools/profile_decode.py --name none-4k-graph --context 4096 --out "$OUT/profile" \
        offload=none graph=cudagraph 2>&1 | grep -v '^\s*$' | head -60 | tee "$OUT/profile_decode.log"
    rm -rf "$OUT/profile"
}

section_ab_gemv() {  # issue 5: batch-1 4K decode with cuBLAS and with the Triton GEMV, interleaved; sparse prefill
                    # pieces on random and on structured-dummy q/k (~5 min)
    timeout 150 python3 tools/profile_sparse_prefill.py 2>&1 | tee "$OUT/sparse_prefill_profile.log"
    local i layer
    for layer in 0 35; do
        timeout 150 python3 tools/profile_sparse_prefill.py --structured-layer $layer 2>&1 \
            | tee -a "$OUT/sparse_prefill_profile.log"
    done
    for i in 1 2; do
        SPARSEKV_GEMV=torch bench "none-4k-b1-cublas-$i" "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096
        SPARSEKV_GEMV=auto bench "none-4k-b1-triton-$i" "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096
    done
}

section_sparse_prefill() {  # issue 4: 128K prefill, full vs xattn_bsa vs minference, on structured dummy weights
                            # (model.load_format=dummy_structured: distance decay + stripes), both offload modes (~7 min)
    local S=(model=qwen3_4b model.load_format=dummy_structured bench.decode_steps=4 bench.context=131072)
    local mode policy
    for mode in none cpu; do
        for policy in full xattn_bsa minference; do
            BENCH_TIMEOUT=120 bench "$mode-$policy-128k-structured" "${S[@]}" offload=$mode policy=$policy
        done
    done
}

section_minference() {  # issue 4: MInference kernels' GPU tests, per-chunk profile (random and structured q/k), 128K
                         # prefill full vs minference, offload=none (~6 min)
    timeout 150 python3 -m pytest -q -m gpu tests/test_minference.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
    local layer
    timeout 150 python3 tools/profile_sparse_prefill.py 2>&1 | tee "$OUT/sparse_prefill_profile.log"
    for layer in 0 35; do
        timeout 150 python3 tools/profile_sparse_prefill.py --structured-layer $layer 2>&1 \
            | tee -a "$OUT/sparse_prefill_profile.log"
    done
    local S=(model=qwen3_4b model.load_format=dummy_structured bench.decode_steps=4 bench.context=131072)
    local policy
    for policy in full minference; do
        BENCH_TIMEOUT=120 bench "none-$policy-128k-structured" "${S[@]}" offload=none policy=$policy
    done
}

section_xattn() {  # issue 4: xattn_bsa kernels' GPU tests, per-chunk profile, 128K prefill offload=none (~4 min)
    timeout 200 python3 -m pytest -q -m gpu tests/test_xattn_kernels.py tests/test_policies.py 2>&1 \
        | tee "$OUT/gpu_tests_xattn.log" | tail -15
    timeout 150 python3 tools/profile_sparse_prefill.py --structured-layer 35 2>&1 | tee "$OUT/xattn_profile.log"
    local S=(model=qwen3_4b model.load_format=dummy_structured bench.decode_steps=4 bench.context=131072)
    BENCH_TIMEOUT=120 bench "none-xattn_bsa-128k-structured" "${S[@]}" offload=none policy=xattn_bsa
}

section_session7() {  # issues 4 and 5, session 7: overlapped decode A/B and batch table, xattn_bsa 0.9 and offloaded
                       # 128K prefill, quality (recall, density) of the prefill policies on planted inputs (~9 min)
    local i b
    for i in 1 2; do
        bench "none-4k-b1-sync-$i" "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096 scheduler.async_decode=false
        bench "none-4k-b1-async-$i" "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096
    done
    for b in 8 32; do
        bench "none-4k-graph-b$b-async" "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096 \
            bench.batch_size=$b scheduler.max_num_seqs=32
    done
    local S=(model=qwen3_4b model.load_format=dummy_structured bench.decode_steps=4 bench.context=131072)
    BENCH_TIMEOUT=120 bench "none-xattn_bsa_090-128k-structured" "${S[@]}" offload=none policy=xattn_bsa_090
    BENCH_TIMEOUT=120 bench "cpu-full-128k-structured" "${S[@]}" offload=cpu policy=full
    BENCH_TIMEOUT=120 bench "cpu-xattn_bsa-128k-structured" "${S[@]}" offload=cpu policy=xattn_bsa
    local policy
    for policy in xattn_bsa xattn_bsa_090 minference; do
        timeout 90 python3 -m sparsekv task=quality policy=$policy quality.context=32768 quality.phase=prefill \
            2>&1 | tail -12 | tee -a "$OUT/quality.log"
    done
}

decode_rows() {  # issue 5's decode rows: GPU-resident 4K at batch 1 (twice), 8 and 32; offloaded 8K, segmented graphs
    local i b
    for i in 1 2; do
        bench "none-4k-b1-$i" "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096
    done
    for b in 8 32; do
        bench "none-4k-b$b" "${QWEN[@]}" offload=none graph=cudagraph bench.context=4096 bench.batch_size=$b \
            scheduler.max_num_seqs=32
    done
    bench "cpu-8k-segmented" "${QWEN[@]}" offload=cpu graph=segmented bench.context=8192
}

section_session8() {  # issues 4 and 5, session 8: decode with fused kernels, PDL and tuned GEMV rows (batch 1/8/32,
                       # offloaded 8K segmented), 128K prefill of full, xattn_bsa_090 (stride 8, 16), minference_band
                       # (~8 min; DECODE_STEPS=64 as in session 7)
    decode_rows
    local S=(model=qwen3_4b model.load_format=dummy_structured bench.decode_steps=4 bench.context=131072 offload=none)
    BENCH_TIMEOUT=120 bench "none-full-128k-structured" "${S[@]}" policy=full
    BENCH_TIMEOUT=120 bench "none-xattn_bsa_090-128k-structured" "${S[@]}" policy=xattn_bsa_090
    BENCH_TIMEOUT=120 bench "none-xattn_bsa_090-s16-128k-structured" "${S[@]}" policy=xattn_bsa_090 policy.stride=16
    BENCH_TIMEOUT=120 bench "none-minference_band-128k-structured" "${S[@]}" policy=minference_band
}

section_session9_minference() {  # issue 4, session 9: 128K prefill of full and minference_band (default, 500/3072,
                                  # 300/2048 budgets) on dummy_structured, then a kernel profile of minference_band
    local S=(model=qwen3_4b model.load_format=dummy_structured bench.decode_steps=4 bench.context=131072 offload=none)
    BENCH_TIMEOUT=120 bench "none-full-128k-structured" "${S[@]}" policy=full
    BENCH_TIMEOUT=120 bench "none-minference_band-128k-structured" "${S[@]}" policy=minference_band
    BENCH_TIMEOUT=120 bench "none-minference_band-v500-s3072-128k-structured" "${S[@]}" policy=minference_band \
        policy.vertical_size=500 policy.slash_size=3072
    BENCH_TIMEOUT=120 bench "none-minference_band-v300-s2048-128k-structured" "${S[@]}" policy=minference_band \
        policy.vertical_size=300 policy.slash_size=2048
    (cd scripts && timeout 150 python3 profile_prefill.py --context 131072 model.load_format=dummy_structured \
        policy=minference_band > "$OUT/profile_minference_band.log" 2>&1)
}

section_session9() {  # issues 4 and 5, session 9 (final code): decode b1 x2 / b8 / b32, offloaded 8K segmented, offloaded
                      # 128K full and quest (4096-token budget), minference_band quality at 32K with the 2.5x budgets
    decode_rows
    BENCH_TIMEOUT=150 bench "cpu-128k" "${QWEN[@]}" offload=cpu bench.context=131072
    BENCH_TIMEOUT=150 bench "cpu-quest-128k" "${QWEN[@]}" offload=cpu policy=quest policy.token_budget=4096 \
        policy.dense_layers=0 bench.context=131072
    local budgets
    for budgets in "500 3072" "300 2048"; do
        set -- $budgets
        timeout 90 python3 -m sparsekv task=quality policy=minference_band policy.vertical_size=$1 \
            policy.slash_size=$2 quality.context=32768 quality.phase=prefill 2>&1 | tail -12 | tee -a "$OUT/quality.log"
    done
}

section_summary() {
    python3 -m sparsekv.tasks.bench summarize "$OUT/bench" 2>&1 | tee "$OUT/bench_summary.md"
    # the device tool returns at most 8 files: pack every run's record and log into one archive
    tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
}

[ $# -gt 0 ] || set -- info tests bench
for SECTION in "$@"; do
    case "$SECTION" in
        session9|session9_minference|session8|session7|xattn|minference|decode_kernels|decode_resident|ab_gemv|sparse_prefill|offload_graphs|segmented|info|tests|bench|kernels|offload|report_sweeps|graph_micro|prefill_lite|quest|gather|prefill|profile|long|longest|graphs|sweep|sweep_hf) "section_$SECTION" ;;
        summary) ;;
        *) echo "usage: OUT=dir $0 [session9|session9_minference|session8|session7|xattn|minference|decode_kernels|decode_resident|ab_gemv|sparse_prefill|offload_graphs|segmented|info|tests|bench|kernels|offload|report_sweeps|graph_micro|prefill_lite|quest|gather|prefill|profile|long|longest|graphs|sweep|sweep_hf|summary]..." >&2; exit 2 ;;
    esac
done
[ -d "$OUT/bench" ] && section_summary
echo "== done ($SECTION) in ${SECONDS}s; logs under $OUT"
exit 0
