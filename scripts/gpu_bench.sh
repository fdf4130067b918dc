#!/usr/bin/env bash
# GPU host: environment report, GPU-marked tests, the issue benchmarks, and a Markdown summary.
#
# Run from the repository root, after carrying the wheels sparsekv needs beyond torch/triton:
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#     OUT=/some/dir scripts/gpu_bench.sh [all|info|tests|bench|summary]     (default: all)
# Everything is written under $OUT:
#     $OUT/info.log                  nvidia-smi, versions, measured ceilings
#     $OUT/gpu_tests.log             python3 -m pytest -q -m gpu tests/
#     $OUT/bench/<name>/bench.json   one record per run (task=bench), run.log beside it, hydra/ Hydra's files
#     $OUT/bench_summary.md          python3 -m sparsekv.tasks.bench summarize $OUT/bench
#     $OUT/status.log                one line per step: name, exit status, seconds
# A failing test or benchmark is logged and the script goes on; it exits 0 unless the environment is broken.
#
# Time: the GPU host gives a session about 30 minutes in all and one command at most 10; each run pays the model
# build (dummy Qwen3-4B weights: ~30 s, drawn on the CPU), the ceilings (~3 s) and one short warm-up. Measured
# on an H200 (2026-11-22): `all` took 140-150 s (tests ~50 s, each offload=none run ~40 s; an offload=cpu run at
# 32K took ~50 s). If one call cannot fit everything, run the sections as separate calls: `tests`, then `bench`
# (which also writes the summary).
# Per-step limits (seconds), overridable: TEST_TIMEOUT (default 240), BENCH_TIMEOUT (default 150);
# DECODE_STEPS (default 32); BENCH_MODEL_ARGS (default "model=qwen3_4b model.load_format=dummy").
set -u
set -o pipefail
export PYTHONUNBUFFERED=1

: "${OUT:?set OUT to the folder the logs go to}"
mkdir -p "$OUT/bench"
SECTION="${1:-all}"
TEST_TIMEOUT="${TEST_TIMEOUT:-240}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-150}"
DECODE_STEPS="${DECODE_STEPS:-32}"

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
    timeout --kill-after=20 "$TEST_TIMEOUT" python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log"
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

section_bench() {  # most needed first: a run cut short keeps what it finished
    bench none-32k       "${QWEN[@]}" offload=none bench.context=32768
    bench cpu-32k        "${QWEN[@]}" offload=cpu bench.context=32768
    bench cpu-128k       "${QWEN[@]}" offload=cpu bench.context=131072
    bench cpu-quest-128k "${QWEN[@]}" offload=cpu policy=quest policy.token_budget=4096 policy.dense_layers=0 bench.context=131072
    bench cpu-xattn-128k "${QWEN[@]}" offload=cpu policy=xattn_bsa bench.context=131072
    bench cpu-minf-128k  "${QWEN[@]}" offload=cpu policy=minference bench.context=131072
    bench none-8k        "${QWEN[@]}" offload=none bench.context=8192
    # GPU memory at 512K: Qwen3-4B layer dimensions, 4 layers (a 36-layer 512K prefill takes minutes)
    bench cpu-512k-4layer "${QWEN[@]}" model.num_hidden_layers=4 offload=cpu bench.context=524288
}

section_summary() {
    python3 -m sparsekv.tasks.bench summarize "$OUT/bench" 2>&1 | tee "$OUT/bench_summary.md"
    # the device tool returns at most 8 files: pack every run's record and log into one archive
    tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
}

case "$SECTION" in
    all)     section_info; section_tests; section_bench; section_summary ;;
    info)    section_info ;;
    tests)   section_tests ;;
    bench)   section_bench; section_summary ;;
    summary) section_summary ;;
    *)       echo "usage: OUT=dir $0 [all|info|tests|bench|summary]" >&2; exit 2 ;;
esac
echo "== done ($SECTION) in ${SECONDS}s; logs under $OUT"
exit 0
