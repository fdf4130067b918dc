#!/usr/bin/env bash
# The figures of docs/benchmarks.md on a GPU host, one section per capability, each writing JSON records.
#
#     OUT=/tmp/bench tools/gpu_bench.sh decode offload quest prefill sparse_prefill memory summary
#     python3 tools/bench_table.py /tmp/bench/records --update docs/benchmarks.md
#
# Sections (each fits a 10-minute limit on an H100; times are rough):
#   info            nvidia-smi, versions, the measured ceilings (python3 -m sparsekv.tasks.bench.floors)
#   tests           the whole suite, one pytest process per part of each tests/ folder (TEST_PARTS, default 3),
#                   each its share of the cores
#   decode          GPU-resident graphed decode at 4K, batch 1 / 8 / 32                                      ~1.5 min
#   offload         offloaded full decode at 8K (whole-step graph and segmented), 32K and 128K with HF beside ~5 min
#   quest           Quest decode at 128K (every layer selecting; the default 2 dense layers) beside full      ~3 min
#   prefill         32K and 128K prefill resident and offloaded (GPU block cache off and on), HF beside, and
#                   resident against offloaded (cache off) at the same chunk size (32K; 128K in 16K and 32K)  ~9 min
#   sparse_prefill  128K resident prefill on structured weights: full, minference (whole prompts, 8K chunks,
#                   500 / 3,000, slash_excludes_vertical), xattn_bsa (the default 0.7 and 0.6), the xattn_bsa_090
#                   preset
#                                                                                                            ~6 min
#   sparse_prefill_scaling  minference and xattn_bsa (default settings) beside full attention at 128K, 256K and 512K
#                   (SCALING_CONTEXTS), offloaded, structured dummy weights (SCALING_POLICIES="xattn_bsa": only
#                   that policy, still beside full; SCALING_OFFLOAD=none: resident, rows named full-524288-none,
#                   512K fits an H200; SCALING_LAYERS=9: that many of the model's layers, rows named
#                   full-1048576-none-9l, for a context whose full row would not finish in one call)      ~10 min
#   sparse_prefill_1m full attention, minference and xattn_bsa at 1M tokens with the fp8 host tier (full ran
#                   past 17 min on an H200 without finishing: give its row a GPU of its own, ONLY_ROWS, detached;
#                   SCALING_POLICIES picks the policies)                                 policies ~8 min, full > 17 min
#   quality         the sparse prefill presets' density, error and needle hits at 32K on planted inputs       ~6 min
#   memory          GPU peak and host RSS of offloaded runs at 32K, 128K and 512K                             ~6 min
#   capacity        the longest context the default host pool holds (prefill alone ~6 min)                    ~10 min
#   hierarchy       KV memory hierarchy: Qwen3-4B 128K full decode with the GPU block cache off / auto and the
#                   fp8 host tier; full attention at 122,880 tokens on Llama-3.1-8B dims, batch 4             ~6 min
#   hierarchy_512k  Qwen3-4B 512K full decode with the GPU block cache off / auto (each prefill ~3 min)       ~9 min
#   hierarchy_batch full attention at 122,880 tokens, batch 8, fp8 host tier, cache off (Llama-3.1-8B dims)  ~3 min
#   hierarchy_curve batched Quest (quest_2k, every layer selecting) beside full attention, Llama-3.1-8B dims, fp8
#                   host tier + GPU block cache auto, 256-token host blocks (CURVE_BLOCK_SIZE: the 2,048-token
#                   budget is the sink, the newest block and 6 chosen ones), each curve from one prefill
#                   (task.batch_curve): 122,880 tokens at batch 1 / 4 / 6 / 8 / 10 and 32,768 at 1 / 4 / 8 / 16,
#                   on CURVE_WEIGHTS (dummy_structured dummy) at CURVE_CONTEXTS (122880 32768), CURVE_SIZES (batch
#                   sizes, e.g. [1,4,8,12]; default [1,4,6,8,10] at 122K, [1,4,8,16] at 32K), CURVE_POLICIES
#                   (quest full), CURVE_TIMEOUT (540 s per row); ~300-330 s per 122K curve (ten prefills), ~100 s
#                   at 32K (pinning the host pool: ~1.3 GB/s)
#   capacity_fp8    the longest context the default host pool holds with the fp8 host tier (about 1.5M tokens
#                   of Qwen3-4B on a 125 GiB host: prefill ~25 min, over a 10-minute limit; CAPACITY_CAP=868352
#                   fits one)                                                                                  ~27 min
#   ruler_policies  model=probe, task=ruler at 4K / 16K / 32K (RULER_LENGTHS), RULER_SAMPLES (10) prompts per task
#                   and length, offload none and cpu (RULER_OFFLOADS): full, quest at 1K / 2K / 4K tokens with the
#                   default 2 dense layers and with every layer selecting, streaming_llm (the plugin in plugins/) at
#                   2K tokens, minference (64-offset bands), minference-diagonals (single diagonals) and
#                   minference-excl (slash_excludes_vertical), xattn_bsa, xattn_bsa_090; at none MInference at
#                   125 / 750, 500 / 3,000 and 1,000 / 6,096 columns / diagonals and XAttention at thresholds 0.6
#                   and 0.8 (around the defaults: 250 / 1,500 and 0.7); at cpu Quest at 6 / 7 / 8 host blocks and at
#                   2K / 4K tokens with 256-token blocks, MInference at 125 / 750 and with the same budgets in every
#                   chunk; then task=report over them; 18 runs at none (40-110 s each on a shared H200), 21 at cpu
#                   (60-120 s): lanes of 3-4 cores sharing a GPU, or
#                   ONLY_ROWS split over more calls (RULER_TIMEOUT: 180 s per run)        ~50 min one run at a time
#                   (ONLY_ROWS="streaming_llm-2048-none minference-cpu ...": rows are named label-offload)
#   tp              TP=1 beside TP=N for N in TP_SIZES (default "1 2"; "1 2 4" on 4 GPUs) per model of TP_MODELS
#                   (default "qwen3_8b llama3_8b", dummy weights), rows of TP_ROWS (default "decode offload
#                   prefill"): resident decode at 4K, offloaded full decode at 128K (no GPU block cache: every step
#                   loads the KV over PCIe), 32K resident prefill; at most 45 + 85 + 40 s per model and TP size.
#                   Rows of one section may run in several calls (or concurrently on disjoint GPUs, resident rows
#                   only) into one OUT: a TP=N row finds its TP=1 row by name
#   summary         $OUT/tables.md (tools/bench_table.py) and $OUT/records.tgz
#
# Each run goes to $OUT/records/<section>/<row>/: the task's record (bench.json or quality.json), run.json (the
# exact command, the date, the row it is compared with) and run.log. A failing run is logged and the script goes on.
# RECORDS_DIR puts the records elsewhere (RECORDS_DIR=/tmp/records with `summary` last leaves $OUT three files:
# status.log, tables.md and records.tgz, for a host that copies back only a few files).
# Settings: ONLY_ROWS ("full xattn_bsa ...": only the runs of those row names), DECODE_STEPS (default 64 for
# `decode`, 16 elsewhere), BENCH_TIMEOUT (default 150 s per run), TEST_TIMEOUT (default 560 s), TEST_PARTS (default 3),
# BENCH_MODEL_ARGS (default "model=qwen3_4b model.load_format=dummy";
# "model=tiny device=cpu" gives a dry run of the script without a GPU; it also replaces llama3_8b in `hierarchy*`).
# HIER_CONTEXT (131072), HIER_LONG_CONTEXT (524288), HIER_BATCH_CONTEXT (122880) and HIER_WIDE_CONTEXT (32768) set
# the contexts of the hierarchy sections (a CPU dry run passes small ones).
set -u
set -o pipefail
export PYTHONUNBUFFERED=1

: "${OUT:?set OUT to the folder the records go to}"
OUT="$(mkdir -p "$OUT" && cd "$OUT" && pwd)"
RECORDS="${RECORDS_DIR:-$OUT/records}"
mkdir -p "$RECORDS" && RECORDS="$(cd "$RECORDS" && pwd)"
TEST_TIMEOUT="${TEST_TIMEOUT:-560}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-150}"
TOOLS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# sparsekv's pure-Python dependencies (hydra-core, omegaconf, antlr4, pluggy) may come as wheels in .whl/
if ! python3 -c "import hydra, omegaconf, pluggy" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ;; esac

read -ra MODEL <<< "${BENCH_MODEL_ARGS:-model=qwen3_4b model.load_format=dummy}"
STRUCTURED=(model=qwen3_4b model.load_format=dummy_structured)
[ -n "${BENCH_MODEL_ARGS:-}" ] && STRUCTURED=("${MODEL[@]}")
LLAMA=(model=llama3_8b model.load_format=dummy)
[ -n "${BENCH_MODEL_ARGS:-}" ] && LLAMA=("${MODEL[@]}")

status() {  # status NAME RC SECONDS
    printf '%-40s rc=%-4s %6ss\n' "$1" "$2" "$3" | tee -a "$OUT/status.log"
}

run_task() {  # run_task SECTION ROW TASK [overrides...]; VS=section/row names the row it is compared with
    local section="$1" row="$2" task="$3"; shift 3
    [ -n "${ONLY_ROWS:-}" ] && [[ " $ONLY_ROWS " != *" $row "* ]] && return 0  # ONLY_ROWS="full xattn_bsa ..."
    local dir="$RECORDS/$section/$row" start=$SECONDS rc
    mkdir -p "$dir"
    local cmd=(python3 -m sparsekv "task=$task" "$@")
    python3 -c 'import json, sys, datetime
section, row, vs, out = sys.argv[1:5]
json.dump({"section": section, "row": row, "vs": vs or None, "command": " ".join(sys.argv[5:]),
           "date": datetime.date.today().isoformat()}, open(out, "w"), indent=2)' \
        "$section" "$row" "${VS:-}" "$dir/run.json" python -m sparsekv "task=$task" "$@"
    echo "==== $section/$row: ${cmd[*]}"
    timeout --signal=INT --kill-after=30 "$BENCH_TIMEOUT" "${cmd[@]}" task.label="$row" ${EXTRA:-} \
        output_dir="$dir" hydra.run.dir="$dir/hydra" > "$dir/run.log" 2>&1
    rc=$?
    tail -n 25 "$dir/run.log"
    rm -rf "$dir/hydra"
    status "$section/$row" "$rc" "$((SECONDS - start))"
}

bench() {  # bench SECTION ROW [overrides...]
    local section="$1" row="$2"; shift 2
    EXTRA=task.progress=false run_task "$section" "$row" bench "$@"
}

section_info() {
    {
        echo "== date";          date -u
        echo "== host";          hostname; nproc; free -g
        echo "== nvidia-smi";    nvidia-smi
        echo "== versions"
        python3 - <<'EOF'
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("triton", "hydra", "omegaconf", "pluggy", "transformers", "flash_attn"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as err:  # noqa: BLE001
        print(name, "unavailable:", type(err).__name__, err)
EOF
        echo "== measured ceilings (python3 -m sparsekv.tasks.bench.floors)"
        timeout 120 python3 -m sparsekv.tasks.bench.floors
    } 2>&1 | tee "$OUT/info.log"
}

section_tests() {  # the whole suite (tests that pick CUDA when present run there too), each folder in TEST_PARTS
    local start=$SECONDS rc=0 dir part pids=() files size parts=${TEST_PARTS:-3} folders=(tests/*/)
    # whole folders (4 processes of 4 threads on a 16-core H100 host) ran e2e and kernels past 540 s; in halves
    # (8 processes of 2 threads, H200) the first e2e half took 530 s, near the per-command limit
    local threads=$(( $(nproc) / (${#folders[@]} * parts) )); [ "$threads" -ge 1 ] || threads=1
    for dir in "${folders[@]}"; do
        dir=${dir%/}; files=("$dir"/test_*.py); size=$(( (${#files[@]} + parts - 1) / parts ))
        for part in $(seq 1 "$parts"); do
            local chosen=("${files[@]:$(( (part - 1) * size )):$size}")
            [ "${#chosen[@]}" -gt 0 ] || continue
            OMP_NUM_THREADS=$threads timeout --kill-after=20 "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider \
                -rfE "${chosen[@]}" ${TEST_ARGS:-} > "$OUT/tests-${dir#tests/}-$part.log" 2>&1 &
            pids+=($!)
        done
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    tail -n 3 "$OUT"/tests-*.log | tee "$OUT/gpu_tests.log"
    status "tests" "$rc" "$((SECONDS - start))"
}

section_decode() {  # GPU-resident, whole-step CUDA graphs, 4K context
    local steps="${DECODE_STEPS:-64}" b
    bench decode none-4k-b1 "${MODEL[@]}" offload=none graph=cudagraph task.context=4096 task.decode_steps="$steps"
    for b in 8 32; do
        bench decode "none-4k-b$b" "${MODEL[@]}" offload=none graph=cudagraph task.context=4096 \
            task.decode_steps="$steps" task.batch_size=$b scheduler.max_num_seqs=32
    done
}

# The offload path itself: the GPU block cache off, so every step loads its KV over PCIe (the hierarchy sections
# measure the cache)
UNCACHED=(offload=cpu offload.gpu_cache_gib=0)

section_offload() {  # full attention, KV in host memory; HF transformers beside the 32K and 128K rows
    local steps="${DECODE_STEPS:-16}"
    bench offload cpu-8k "${MODEL[@]}" "${UNCACHED[@]}" task.context=8192 task.decode_steps="$steps"
    bench offload cpu-8k-segmented "${MODEL[@]}" "${UNCACHED[@]}" graph=segmented task.context=8192 \
        task.decode_steps="$steps"
    BENCH_TIMEOUT=200 bench offload cpu-32k-hf "${MODEL[@]}" "${UNCACHED[@]}" task.context=32768 \
        task.decode_steps="$steps" task.baseline=true
    BENCH_TIMEOUT=300 bench offload cpu-128k-hf "${MODEL[@]}" "${UNCACHED[@]}" task.context=131072 \
        task.decode_steps="${DECODE_STEPS:-8}" task.baseline=true
}

section_quest() {  # Quest at 128K against full offloaded decode in the same run
    local steps="${DECODE_STEPS:-16}"
    bench quest cpu-128k-full "${MODEL[@]}" "${UNCACHED[@]}" task.context=131072 task.decode_steps="$steps"
    VS=quest/cpu-128k-full bench quest cpu-quest-128k-all-layers "${MODEL[@]}" "${UNCACHED[@]}" policy=quest \
        policy.token_budget=4096 policy.dense_layers=0 task.context=131072 task.decode_steps="$steps"
    VS=quest/cpu-128k-full bench quest cpu-quest-128k-default "${MODEL[@]}" "${UNCACHED[@]}" policy=quest \
        task.context=131072 task.decode_steps="$steps"
}

section_prefill() {  # full-attention prefill; HF transformers beside the 32K rows
    bench prefill none-32k-1chunk-hf "${MODEL[@]}" offload=none task.context=32768 \
        scheduler.max_num_batched_tokens=32768 task.decode_steps=4 task.baseline=true
    bench prefill cpu-32k-hf "${MODEL[@]}" "${UNCACHED[@]}" task.context=32768 task.decode_steps=4 task.baseline=true
    VS=prefill/none-32k-1chunk-hf bench prefill cpu-32k-cache "${MODEL[@]}" offload=cpu task.context=32768 \
        task.decode_steps=4
    bench prefill none-128k-hf "${MODEL[@]}" offload=none task.context=131072 task.decode_steps=4 task.baseline=true
    # offloaded with every chunk's earlier blocks streamed over PCIe (cache off), and with the default cache
    VS=prefill/none-128k-hf bench prefill cpu-128k "${MODEL[@]}" "${UNCACHED[@]}" task.context=131072 \
        task.decode_steps=4
    VS=prefill/none-128k-hf bench prefill cpu-128k-cache "${MODEL[@]}" offload=cpu task.context=131072 \
        task.decode_steps=4
    # the same chunk size resident and offloaded (cache off): what streaming the earlier blocks costs, chunk for chunk
    VS=prefill/none-32k-1chunk-hf bench prefill cpu-32k-1chunk "${MODEL[@]}" "${UNCACHED[@]}" task.context=32768 \
        offload.prefill_chunk_size=32768 scheduler.max_num_batched_tokens=32768 task.decode_steps=4
    local chunk
    for chunk in 16384 32768; do
        bench prefill "none-128k-chunk$chunk" "${MODEL[@]}" offload=none task.context=131072 \
            scheduler.max_num_batched_tokens=$chunk task.decode_steps=4
        VS="prefill/none-128k-chunk$chunk" bench prefill "cpu-128k-chunk$chunk" "${MODEL[@]}" "${UNCACHED[@]}" \
            task.context=131072 offload.prefill_chunk_size=$chunk scheduler.max_num_batched_tokens=$chunk \
            task.decode_steps=4
    done
    # a ring of 32 slots: the cache-off prefix streams in groups of 16 blocks (16K keys) instead of 4
    VS="prefill/none-128k-chunk16384" bench prefill "cpu-128k-chunk16384-ring32" "${MODEL[@]}" "${UNCACHED[@]}" \
        task.context=131072 offload.prefill_chunk_size=16384 scheduler.max_num_batched_tokens=16384 \
        offload.num_gpu_blocks=32 task.decode_steps=4
}

section_sparse_prefill() {  # 128K, GPU-resident, weights with planted attention structure; each preset against full
    local S=("${STRUCTURED[@]}" offload=none task.context=131072 task.decode_steps=4)
    bench sparse_prefill full "${S[@]}" policy=full
    VS=sparse_prefill/full bench sparse_prefill minference "${S[@]}" policy=minference
    VS=sparse_prefill/full bench sparse_prefill minference-chunked "${S[@]}" policy=minference \
        policy.whole_prompt_prefill=false
    VS=sparse_prefill/full bench sparse_prefill minference-v500-s3000 "${S[@]}" policy=minference \
        policy.vertical_size=500 policy.slash_size=3000
    VS=sparse_prefill/full bench sparse_prefill minference-excl "${S[@]}" policy=minference \
        policy.slash_excludes_vertical=true
    VS=sparse_prefill/full bench sparse_prefill xattn_bsa "${S[@]}" policy=xattn_bsa
    VS=sparse_prefill/full bench sparse_prefill xattn_bsa_060 "${S[@]}" policy=xattn_bsa policy.threshold=0.6
    VS=sparse_prefill/full bench sparse_prefill xattn_bsa_090 "${S[@]}" policy=xattn_bsa_090
}

section_sparse_prefill_scaling() {  # sparse prefill from 128K to 512K beside full attention, structured weights
    local ctx policy offload="${SCALING_OFFLOAD:-cpu}" tag="" layers=()
    [ "$offload" != cpu ] && tag="-$offload"  # resident rows: full-524288-none
    if [ -n "${SCALING_LAYERS:-}" ]; then
        tag="$tag-${SCALING_LAYERS}l"
        layers=(model.num_hidden_layers="$SCALING_LAYERS")
    fi
    for ctx in ${SCALING_CONTEXTS:-131072 262144 524288}; do
        local S=("${STRUCTURED[@]}" "${layers[@]}" offload="$offload" task.context="$ctx" task.decode_steps=2)
        BENCH_TIMEOUT=300 bench sparse_prefill_scaling "full-$ctx$tag" "${S[@]}" policy=full
        for policy in ${SCALING_POLICIES:-minference xattn_bsa}; do
            VS="sparse_prefill_scaling/full-$ctx$tag" BENCH_TIMEOUT=300 bench sparse_prefill_scaling \
                "$policy-$ctx$tag" "${S[@]}" policy="$policy"
        done
    done
}

section_sparse_prefill_1m() {  # 1M tokens with the fp8 host tier (144 GiB of bf16 KV would not fit the host)
    # full attention reads its fp8 prefix for every chunk and ran past 17 minutes on an H200 without finishing: on a
    # machine with a per-command limit, run its row detached on a GPU of its own (ONLY_ROWS)
    local S=("${STRUCTURED[@]}" offload=cpu offload.host_dtype=float8_e4m3fn task.context=1048576 task.decode_steps=2)
    local policy
    BENCH_TIMEOUT=3600 bench sparse_prefill_scaling full-1048576-fp8 "${S[@]}" policy=full
    for policy in ${SCALING_POLICIES:-minference xattn_bsa}; do
        VS=sparse_prefill_scaling/full-1048576-fp8 BENCH_TIMEOUT=560 bench sparse_prefill_scaling \
            "$policy-1048576-fp8" "${S[@]}" policy="$policy"
    done
}

section_quality() {  # the sparse prefill presets on planted inputs at 32K: density, error, needle hits
    local Q=(task.context=32768 task.phase=prefill)
    BENCH_TIMEOUT=90 run_task quality minference quality policy=minference "${Q[@]}"
    BENCH_TIMEOUT=90 run_task quality minference-v500-s3072 quality policy=minference \
        policy.vertical_size=500 policy.slash_size=3072 "${Q[@]}"
    BENCH_TIMEOUT=90 run_task quality minference-v300-s2048 quality policy=minference \
        policy.vertical_size=300 policy.slash_size=2048 "${Q[@]}"
    BENCH_TIMEOUT=90 run_task quality xattn_bsa_090 quality policy=xattn_bsa_090 "${Q[@]}"
    BENCH_TIMEOUT=90 run_task quality xattn_bsa_090-stride16 quality policy=xattn_bsa_090 policy.stride=16 "${Q[@]}"
}

section_memory() {  # GPU memory stays flat while the context grows (offloaded); 512K pins ~72 GiB of host memory
    bench memory cpu-32k "${MODEL[@]}" "${UNCACHED[@]}" task.context=32768 task.decode_steps=4
    bench memory cpu-128k "${MODEL[@]}" "${UNCACHED[@]}" task.context=131072 task.decode_steps=4
    BENCH_TIMEOUT=560 bench memory cpu-512k "${MODEL[@]}" "${UNCACHED[@]}" task.context=524288 task.decode_steps=4
}

section_capacity() {  # the longest prompt the default host pool holds (Qwen3-4B: 144 KiB of KV per token)
    local ctx
    ctx=$(python3 -c "
from sparsekv.kvcache.offload_store import host_pool_blocks
per_token = 36 * 8 * 128 * 2 * 2
pool_tokens = host_pool_blocks(None, 1024 * per_token) * 1024  # the default pool: 0.9 x available - 4 GiB
print(min(${CAPACITY_CAP:-786432}, (pool_tokens - 16384) // 16384 * 16384))")
    echo "== capacity: default host pool -> context $ctx" | tee -a "$OUT/status.log"
    BENCH_TIMEOUT="${BENCH_TIMEOUT_CAPACITY:-575}" bench capacity "cpu-$ctx" "${MODEL[@]}" "${UNCACHED[@]}" \
        task.context="$ctx" task.decode_steps=16
}

section_hierarchy() {  # GPU block cache off / auto, fp8 host tier, a batch of full attention at 122K
    local steps="${DECODE_STEPS:-16}" ctx="${HIER_CONTEXT:-131072}" bctx="${HIER_BATCH_CONTEXT:-122880}"
    local C=(offload=cpu task.context="$ctx" task.decode_steps="$steps")
    # batch 1 with the cache off: the offloaded decode path against the offload section's figure (no regression)
    VS=offload/cpu-128k-hf bench hierarchy cpu-128k-cache-off "${MODEL[@]}" "${C[@]}" offload.gpu_cache_gib=0
    VS=hierarchy/cpu-128k-cache-off bench hierarchy cpu-128k-cache-auto "${MODEL[@]}" "${C[@]}" \
        offload.gpu_cache_gib=auto
    # fp8 host blocks: half the bytes per step (the record's decode_h2d_bytes_per_step, decode_pcie_floor_ms)
    VS=hierarchy/cpu-128k-cache-off bench hierarchy cpu-128k-fp8 "${MODEL[@]}" "${C[@]}" offload.gpu_cache_gib=0 \
        offload.host_dtype=float8_e4m3fn
    # full attention at ~122K (ShadowKV's shape), batch 4, 1,024-token blocks (batched Quest: hierarchy_curve)
    BENCH_TIMEOUT=200 bench hierarchy "llama-122k-full-b4" "${LLAMA[@]}" offload=cpu task.context="$bctx" \
        task.decode_steps="$steps" offload.gpu_cache_gib=auto task.batch_size=4
}

section_hierarchy_512k() {  # 512K full decode (72 GiB of host KV): the GPU block cache holds part of it
    local steps="${DECODE_STEPS:-8}" ctx="${HIER_LONG_CONTEXT:-524288}"
    local C=(offload=cpu task.context="$ctx" task.decode_steps="$steps")
    BENCH_TIMEOUT=290 bench hierarchy cpu-512k-cache-off "${MODEL[@]}" "${C[@]}" offload.gpu_cache_gib=0
    VS=hierarchy/cpu-512k-cache-off BENCH_TIMEOUT=290 bench hierarchy cpu-512k-cache-auto "${MODEL[@]}" "${C[@]}" \
        offload.gpu_cache_gib=auto
}

section_hierarchy_batch() {  # the fp8 host tier holds twice the sequences (15.0 -> 7.5 GiB each at 122K): full
    # attention at batch 8 with the cache off (batched Quest: hierarchy_curve, on 256-token blocks)
    local steps="${DECODE_STEPS:-8}" bctx="${HIER_BATCH_CONTEXT:-122880}"
    BENCH_TIMEOUT=200 bench hierarchy "llama-122k-fp8-full-b8" "${LLAMA[@]}" offload=cpu task.decode_steps="$steps" \
        offload.gpu_cache_gib=0 offload.host_dtype=float8_e4m3fn task.context="$bctx" task.batch_size=8
}

section_hierarchy_curve() {  # batched Quest beside full attention, batch 1 up, each curve from one prefill
    # (task.batch_curve); Llama-3.1-8B dims, fp8 host tier, GPU block cache auto; CURVE_WEIGHTS (dummy_structured
    # dummy) and CURVE_CONTEXTS (122880 32768; the 32K curve goes wider); Quest first: a tight limit drops full
    local steps="${DECODE_STEPS:-8}" weights ctx curve top row
    for weights in ${CURVE_WEIGHTS:-dummy_structured dummy}; do
        local W=(model=llama3_8b model.load_format="$weights")
        [ -n "${BENCH_MODEL_ARGS:-}" ] && W=("${MODEL[@]}")
        for ctx in ${CURVE_CONTEXTS:-122880 32768}; do
            curve="[1,4,6,8,10]"
            [ "$ctx" -le 32768 ] && curve="[1,4,8,16]"
            curve="${CURVE_SIZES:-$curve}"; top=$(tr -d '[]' <<< "$curve" | tr ',' '\n' | sort -n | tail -1)
            local C=(offload=cpu offload.host_dtype=float8_e4m3fn offload.gpu_cache_gib=auto task.context="$ctx"
                     offload.block_size="${CURVE_BLOCK_SIZE:-256}"
                     task.decode_steps="$steps" task.batch_size=$top "task.batch_curve=$curve")
            row="llama-$((ctx / 1000))k-fp8-cache-$weights"
            [[ " ${CURVE_POLICIES:-quest full} " == *" quest "* ]] && VS="hierarchy/$row-full-curve" \
                BENCH_TIMEOUT="${CURVE_TIMEOUT:-540}" bench hierarchy "$row-quest-curve" \
                "${W[@]}" "${C[@]}" policy=quest_2k policy.dense_layers=0
            [[ " ${CURVE_POLICIES:-quest full} " == *" full "* ]] && \
                BENCH_TIMEOUT="${CURVE_TIMEOUT:-540}" bench hierarchy "$row-full-curve" "${W[@]}" "${C[@]}" policy=full
        done
    done
    return 0
}

section_capacity_fp8() {  # the longest prompt the default host pool holds with fp8 host blocks (+ 16 decode steps)
    local ctx
    ctx=$(python3 -c "
import torch
from sparsekv.kvcache.host_quant import host_block_bytes
from sparsekv.kvcache.offload_store import host_pool_blocks
block = host_block_bytes(36, 1024, 8, 128, torch.float8_e4m3fn)  # Qwen3-4B, fp8 K/V + a float32 scale per KV head
pool_tokens = host_pool_blocks(None, block) * 1024  # the default pool: 0.9 x available - 4 GiB
print(min(${CAPACITY_CAP:-4194304}, (pool_tokens - 16384) // 16384 * 16384))")
    # CAPACITY_POLICY (default full): streaming_llm-2048 (the plugin, 2 of the 1,024-token host blocks per chunk and
    # step) makes the prefill linear in the context, so the host tier's capacity is measured inside one call
    local policy="${CAPACITY_POLICY:-full}" P=() site=""
    case "$policy" in
        full) ;;
        streaming_llm-2048) site=$(plugin_site); P=(policy=streaming_llm policy.sink_blocks=1 policy.recent_blocks=1) ;;
        *) echo "CAPACITY_POLICY=$policy: use full or streaming_llm-2048" >&2; return 1 ;;
    esac
    local row="cpu-fp8-$ctx"; [ "$policy" = full ] || row="$row-$policy"
    echo "== capacity_fp8: default host pool, fp8, $policy -> context $ctx" | tee -a "$OUT/status.log"
    PYTHONPATH="${site:+$site:}$PYTHONPATH" VS=capacity/cpu-770048 BENCH_TIMEOUT="${BENCH_TIMEOUT_CAPACITY:-1800}" \
        bench capacity "$row" "${MODEL[@]}" offload=cpu offload.host_dtype=float8_e4m3fn offload.gpu_cache_gib=0 \
        task.context="$ctx" task.decode_steps=16 "${P[@]}"
}

# prints a scratch site holding the streaming_llm plugin of plugins/ (its entry point is read from sys.path)
plugin_site() {
    local site="$OUT/plugin-site" src="$OUT/plugin-src"
    if [ ! -d "$site" ]; then
        rm -rf "$src" && cp -r "$TOOLS/../plugins/sparsekv-streamingllm" "$src"
        python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$site" "$src" >&2 \
            || echo "streaming_llm plugin did not install: its rows will fail" | tee -a "$OUT/status.log" >&2
    fi
    echo "$site"
}

section_ruler_policies() {  # the policies judged on the probe: accuracy per task, density, prefill and decode time
    local lengths="${RULER_LENGTHS:-[4096,16384,32768]}" samples="${RULER_SAMPLES:-10}" off row args
    local site
    site=$(plugin_site)
    local ROWS=("full|policy=full")
    for budget in 1024 2048 4096; do
        ROWS+=("quest-$budget|policy=quest policy.token_budget=$budget"
               "quest-$budget-all-layers|policy=quest policy.token_budget=$budget policy.dense_layers=0")
    done
    ROWS+=("streaming_llm-2048|policy=streaming_llm policy.sink_blocks=1 policy.recent_blocks=7"
           "minference|policy=minference" "minference-diagonals|policy=minference policy.slash_granularity=1"
           "minference-excl|policy=minference policy.slash_excludes_vertical=true"
           "xattn_bsa|policy=xattn_bsa" "xattn_bsa_090|policy=xattn_bsa_090")
    # the budgets around the prefill policies' defaults, resident only (their defaults are set from these rows)
    local NONE_ROWS=("minference-v125-s750|policy=minference policy.vertical_size=125 policy.slash_size=750"
                     "minference-v500-s3000|policy=minference policy.vertical_size=500 policy.slash_size=3000"
                     "minference-v1000-s6096|policy=minference policy.vertical_size=1000 policy.slash_size=6096"
                     "xattn_bsa_060|policy=xattn_bsa policy.threshold=0.6"
                     "xattn_bsa_080|policy=xattn_bsa policy.threshold=0.8")
    # offload=cpu selects among host blocks of 1,024 tokens, where a 2,048-token budget is the sink and the newest
    # block alone: Quest at 6, 7 and 8 blocks (its default keeps at least 7), and with the resident store's 256-token
    # blocks; MInference at half its default budgets, and with the same budgets in every chunk
    # (early_chunk_budget_scale=1; its default doubles them in the chunks before the prompt's last)
    local CPU_ROWS=("quest-6144|policy=quest policy.token_budget=6144"
                    "quest-7168|policy=quest policy.token_budget=7168"
                    "quest-8192|policy=quest policy.token_budget=8192"
                    "minference-v125-s750|policy=minference policy.vertical_size=125 policy.slash_size=750"
                    "quest-2048-block256|policy=quest policy.token_budget=2048 offload.block_size=256"
                    "quest-4096-block256|policy=quest policy.token_budget=4096 offload.block_size=256"
                    "minference-scale1|policy=minference policy.early_chunk_budget_scale=1"
                    "minference-v500-s3000-scale1|policy=minference policy.vertical_size=500 policy.slash_size=3000 \
                     policy.early_chunk_budget_scale=1")
    for off in ${RULER_OFFLOADS:-none cpu}; do
        local rows=("${ROWS[@]}")
        [ "$off" = cpu ] && rows+=("${CPU_ROWS[@]}")
        [ "$off" = none ] && rows+=("${NONE_ROWS[@]}")
        for row in "${rows[@]}"; do
            read -ra args <<< "${row#*|}"
            PYTHONPATH="$site:$PYTHONPATH" EXTRA=task.progress=false BENCH_TIMEOUT="${RULER_TIMEOUT:-180}" \
                run_task ruler_policies "${row%%|*}-$off" ruler model=probe offload="$off" "${args[@]}" \
                "task.lengths=$lengths" task.samples="$samples" task.batch_size="$samples"
        done
    done
    python3 -m sparsekv task=report task.dir="$RECORDS/ruler_policies" hydra.run.dir="$OUT/report-hydra" \
        > "$OUT/ruler_policies_report.log" 2>&1 || tail -n 20 "$OUT/ruler_policies_report.log"
}

section_tp() {  # tensor parallelism; each TP=N>1 row is compared with the TP=1 row of the same shape
    local steps="${DECODE_STEPS:-16}" model tp ref rows=" ${TP_ROWS:-decode offload prefill} "
    for model in ${TP_MODELS:-qwen3_8b llama3_8b}; do
        for tp in ${TP_SIZES:-1 2}; do
            local P=(model="$model" model.load_format=dummy parallel.tensor_parallel_size=$tp)
            ref=""; [ "$tp" != 1 ] && ref="tp/$model-"
            [[ $rows == *" decode "* ]] && VS="${ref:+${ref}none-4k-tp1}" BENCH_TIMEOUT=45 \
                bench tp "$model-none-4k-tp$tp" "${P[@]}" offload=none graph=cudagraph task.context=4096 \
                task.decode_steps="${DECODE_STEPS:-64}"
            [[ $rows == *" offload "* ]] && VS="${ref:+${ref}cpu-128k-tp1}" BENCH_TIMEOUT=85 \
                bench tp "$model-cpu-128k-tp$tp" "${P[@]}" offload=cpu offload.gpu_cache_gib=0 task.context=131072 \
                task.decode_steps="$steps"
            [[ $rows == *" prefill "* ]] && VS="${ref:+${ref}none-32k-prefill-tp1}" BENCH_TIMEOUT=40 \
                bench tp "$model-none-32k-prefill-tp$tp" "${P[@]}" offload=none task.context=32768 \
                scheduler.max_num_batched_tokens=32768 task.decode_steps=4
        done
    done
    return 0
}

section_summary() {
    python3 "$TOOLS/bench_table.py" "$RECORDS" 2>&1 | tee "$OUT/tables.md"
    tar czf "$OUT/records.tgz" -C "$(dirname "$RECORDS")" "$(basename "$RECORDS")"
}

SECTIONS="info tests decode offload quest prefill sparse_prefill sparse_prefill_scaling sparse_prefill_1m quality"
SECTIONS="$SECTIONS memory capacity"
SECTIONS="$SECTIONS hierarchy hierarchy_512k hierarchy_batch hierarchy_curve capacity_fp8 ruler_policies tp summary"
[ $# -gt 0 ] || set -- info decode offload quest prefill sparse_prefill memory summary
for SECTION in "$@"; do
    case " $SECTIONS " in
        *" $SECTION "*) "section_$SECTION" ;;
        *) echo "usage: OUT=dir $0 [${SECTIONS// /|}]..." >&2; exit 2 ;;
    esac
done
echo "== done ($*) in ${SECONDS}s; records under $RECORDS"
exit 0
