#!/usr/bin/env bash
# Time to first token on a GPU host: wall time of `python -m sparsekv` (task=generate) on empty and on warm caches,
# and LLM() construction in a process whose caches are warm.
#
#     tools/startup_bench.sh                 # model=qwen3_4b model.load_format=dummy sampling.max_tokens=64
#     STARTUP_MODEL_ARGS="model=tiny device=cpu" tools/startup_bench.sh    # a dry run without a GPU
#
# Runs, each printing its wall time, the generate summary line (start-up / compile / steady state) and the graph
# capture lines:
#   fresh         empty Triton cache (TRITON_CACHE_DIR), empty .pyc cache (PYTHONPYCACHEPREFIX: every module,
#                 torch's own included, is byte-compiled again) and an empty CUDA JIT cache: a fresh machine as far as
#                 one process can make it. Python's byte-compiling of torch is not sparsekv's to fix; the next run
#                 shows the share it has.
#   fresh-triton  empty Triton cache, warm .pyc cache: the kernel compile share alone
#   fresh-serial  the same with compile_workers=0 (each kernel compiled at its first launch, one after another)
#   fresh-install empty Triton and CUDA caches, .pyc files for every installed package (pip writes them at install)
#                 but none for this checkout's modules: a machine right after the README's set-up command
#   second        every cache warm (the same directories as `fresh`)
#   second-no-pyc the same with PYTHONDONTWRITEBYTECODE=1 (some images set it: Python then byte-compiles every
#                 module, torch's included, in every process, since no .pyc is ever written)
#   llm-api       in one process: `from sparsekv import LLM`, LLM() twice (the second in a warm process), two
#                 generate(64) (equal figures: nothing compiled inside the first), and whether torch._dynamo was
#                 imported (it should not be)
# Everything goes under $OUT (default: a new temporary folder); the caches are deleted at the end unless KEEP=1.
set -u
set -o pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# sparsekv's pure-Python dependencies (hydra-core, omegaconf, antlr4, pluggy) may come as wheels in .whl/
if ! python3 -c "import hydra, omegaconf, pluggy" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ;; esac
OUT="${OUT:-$(mktemp -d /tmp/startup_bench.XXXXXX)}"
mkdir -p "$OUT"
read -ra MODEL <<< "${STARTUP_MODEL_ARGS:-model=qwen3_4b model.load_format=dummy}"
MAX_TOKENS="${MAX_TOKENS:-64}"

generate() {  # generate LABEL [OVERRIDE ...]: one CLI run with the cache directories exported by the caller
    local label="$1" start end rc
    shift
    start=$(date +%s.%N)
    python3 -m sparsekv "${MODEL[@]}" "sampling.max_tokens=$MAX_TOKENS" task.progress=false "$@" \
        hydra.run.dir="$OUT/$label" > "$OUT/$label.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    printf '==== %-13s wall %6.2f s  rc=%s\n' "$label" "$(awk "BEGIN { print $end - $start }")" "$rc"
    grep -E '^(start-up|prompt tokens)|captured graphs|compiled .* ahead|warning' "$OUT/$label.log" | sed 's/^/    /'
    [ "$rc" = 0 ] || tail -n 20 "$OUT/$label.log"
}

caches() {  # caches NAME: point every compiler cache at $OUT/NAME
    export TRITON_CACHE_DIR="$OUT/$1/triton" PYTHONPYCACHEPREFIX="$OUT/$1/pyc" CUDA_CACHE_PATH="$OUT/$1/cuda"
    export TORCHINDUCTOR_CACHE_DIR="$OUT/$1/inductor"
}

# the runs above assume Python writes its .pyc files (its default); an image may have turned that off
echo "PYTHONDONTWRITEBYTECODE in the environment: ${PYTHONDONTWRITEBYTECODE:-unset}" \
    "(unset for the runs but second-no-pyc)"
unset PYTHONDONTWRITEBYTECODE
rm -rf "$OUT/cache-a" "$OUT/cache-b" "$OUT/cache-c" "$OUT/cache-d"
caches cache-a
generate fresh
generate second
PYTHONDONTWRITEBYTECODE=1 generate second-no-pyc
# warm .pyc cache (cache-a's), empty Triton and CUDA caches
export TRITON_CACHE_DIR="$OUT/cache-b/triton" CUDA_CACHE_PATH="$OUT/cache-b/cuda"
generate fresh-triton
# the same with every kernel compiled serially at its first launch (compile_workers=0): what compiling ahead saves
export TRITON_CACHE_DIR="$OUT/cache-c/triton" CUDA_CACHE_PATH="$OUT/cache-c/cuda"
generate fresh-serial compile_workers=0
# a machine just set up: pip wrote the installed packages' .pyc files, this checkout has none, compiler caches empty
mkdir -p "$OUT/cache-d" && cp -r "$OUT/cache-a/pyc" "$OUT/cache-d/pyc" && rm -rf "$OUT/cache-d/pyc$PWD"
export TRITON_CACHE_DIR="$OUT/cache-d/triton" CUDA_CACHE_PATH="$OUT/cache-d/cuda" PYTHONPYCACHEPREFIX="$OUT/cache-d/pyc"
generate fresh-install

caches cache-a
echo "==== llm-api (warm caches)"
python3 - "${MODEL[@]}" <<'EOF' 2>&1 | grep -v '^\[' | sed 's/^/    /'
import sys
import time

start = time.perf_counter()
from sparsekv import LLM, SamplingParams  # noqa: E402

imported = time.perf_counter()
print(f"from sparsekv import LLM: {imported - start:.2f} s")
overrides = [a for a in sys.argv[1:] if not a.startswith("model=")]
model = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("model=")), None)
for attempt in ("first", "second"):
    start = time.perf_counter()
    llm = LLM(model, overrides=overrides)
    print(f"LLM() {attempt}: {time.perf_counter() - start:.2f} s; startup {llm.engine.startup}; "
          f"graphs {llm.engine.graph_stats.get('batch_sizes')} in "
          f"{llm.engine.graph_stats.get('capture_seconds', 0):.2f} s")
    if attempt == "first":
        del llm
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
from sparsekv.engine.llm_engine import RunStats  # noqa: E402

for attempt in ("first", "second"):  # equal figures: no kernel compiled or graph captured inside the first
    llm.engine.stats = RunStats()
    captured = llm.engine.graph_stats.get("capture_seconds", 0.0)
    start = time.perf_counter()
    llm.generate("The quick brown fox jumps over the lazy dog. Long context inference is",
                 SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), progress=False)
    summary = llm.engine.summary()
    print(f"generate(64) {attempt}: {time.perf_counter() - start:.2f} s; prefill {summary['prefill_tok_s']:.0f} "
          f"tok/s, decode {summary['decode_ms_per_token']:.2f} ms/token, graphs captured inside: "
          f"{llm.engine.graph_stats.get('capture_seconds', 0.0) - captured:.2f} s")
print("torch._dynamo imported:", "torch._dynamo" in sys.modules)
EOF

[ "${KEEP:-0}" = 1 ] || rm -rf "$OUT/cache-a" "$OUT/cache-b" "$OUT/cache-c" "$OUT/cache-d"
echo "logs: $OUT"
