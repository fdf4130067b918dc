#!/usr/bin/env bash
# Before/after table of the rows that must not regress, for two checkouts on one GPU in one run.
#
#     tools/bench_regression.sh BEFORE_DIR AFTER_DIR OUT_DIR
#
# BEFORE_DIR: a checkout whose CLI takes bench settings as `bench.context=...`; AFTER_DIR: one that takes them as
# `task.context=...` (set BEFORE_SYNTAX / AFTER_SYNTAX to `bench` or `task` to say otherwise). Rows run interleaved,
# before then after, one process per row and tree, each with its own Python path, so both trees meet the same GPU
# state. Qwen3-4B dimensions (`model=qwen3_4b model.load_format=dummy`; `dummy_structured` for the sparse prefill
# rows). Records go to OUT_DIR/<row>/<before|after>/; the Markdown table is printed and written to OUT_DIR/table.md.
# About 8-9 minutes on an H100 (each process ~15 s of start-up; the 128K offloaded rows ~40 s each).
set -u
set -o pipefail
export PYTHONUNBUFFERED=1

if [ $# -ne 3 ]; then
    echo "usage: $0 BEFORE_DIR AFTER_DIR OUT_DIR   (two sparsekv checkouts; OUT_DIR receives records and table.md)" >&2
    exit 2
fi
BEFORE="$(cd "$1" && pwd)" || { echo "BEFORE_DIR=$1 is not a directory" >&2; exit 2; }
AFTER="$(cd "$2" && pwd)" || { echo "AFTER_DIR=$2 is not a directory" >&2; exit 2; }
mkdir -p "$3" && OUT="$(cd "$3" && pwd)"
for tree in "$BEFORE" "$AFTER"; do
    [ -d "$tree/sparsekv" ] \
        || { echo "$tree has no sparsekv/ package: pass the root of a sparsekv checkout" >&2; exit 2; }
done
BEFORE_SYNTAX="${BEFORE_SYNTAX:-bench}"
AFTER_SYNTAX="${AFTER_SYNTAX:-task}"
RUN_TIMEOUT="${RUN_TIMEOUT:-150}"

MODEL=(model=qwen3_4b model.load_format=dummy)
STRUCTURED=(model=qwen3_4b model.load_format=dummy_structured)
if [ -n "${REGRESSION_MODEL_ARGS:-}" ]; then  # e.g. "model=tiny device=cpu": a dry run of the script itself
    read -ra MODEL <<< "$REGRESSION_MODEL_ARGS"
    STRUCTURED=("${MODEL[@]}")
fi

# ROWS: "name|metric|overrides", where {b} stands for the bench settings' prefix (bench. or task.).
# metric: decode (decode_ms_per_token) or prefill (prefill_seconds). The 32K offloaded row gives both.
ROWS=(
    "graphed 4K decode|decode|${MODEL[*]} offload=none graph=cudagraph {b}context=4096 {b}decode_steps=32"
    "offloaded 32K decode + prefill|decode,prefill|${MODEL[*]} offload=cpu {b}context=32768 {b}decode_steps=16"
    "offloaded 128K decode|decode|${MODEL[*]} offload=cpu {b}context=131072 {b}decode_steps=8"
    "quest 128K decode, default|decode|${MODEL[*]} offload=cpu policy=quest {b}context=131072 {b}decode_steps=16"
    "quest 128K decode, token_budget=4096 dense_layers=0|decode|${MODEL[*]} offload=cpu policy=quest \
        policy.token_budget=4096 policy.dense_layers=0 {b}context=131072 {b}decode_steps=16"
    "32K resident prefill|prefill|${MODEL[*]} offload=none {b}context=32768 \
        scheduler.max_num_batched_tokens=32768 {b}decode_steps=2"
    "128K minference prefill (64-offset bands)|prefill|${STRUCTURED[*]} offload=none policy=minference \
        policy.slash_granularity=64 {b}context=131072 {b}decode_steps=2"
    "128K xattn_bsa_090 prefill|prefill|${STRUCTURED[*]} offload=none policy=xattn_bsa_090 \
        {b}context=131072 {b}decode_steps=2"
)

run_one() {  # run_one TREE SYNTAX DIR OVERRIDES
    local tree="$1" syntax="$2" dir="$3" overrides="$4" start=$SECONDS rc
    mkdir -p "$dir"
    local args
    read -ra args <<< "${overrides//\{b\}/$syntax.}"
    echo "$tree: python3 -m sparsekv task=bench ${args[*]}" > "$dir/command.txt"
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout --signal=INT --kill-after=20 "$RUN_TIMEOUT" \
        python3 -m sparsekv task=bench "${args[@]}" "$syntax.measure_floors=false" "$syntax.progress=false" \
        output_dir="$dir" hydra.run.dir="$dir/hydra") > "$dir/run.log" 2>&1
    rc=$?
    rm -rf "$dir/hydra"
    printf '%-60s rc=%-3s %4ss\n' "${dir#"$OUT"/}" "$rc" "$((SECONDS - start))" | tee -a "$OUT/status.log"
}

: > "$OUT/status.log"
for i in "${!ROWS[@]}"; do
    IFS='|' read -r name metric overrides <<< "${ROWS[$i]}"
    run_one "$BEFORE" "$BEFORE_SYNTAX" "$OUT/row$i/before" "$overrides"
    run_one "$AFTER" "$AFTER_SYNTAX" "$OUT/row$i/after" "$overrides"
    printf '%s|%s\n' "$name" "$metric" > "$OUT/row$i/row.txt"
done

python3 - "$OUT" <<'EOF' | tee "$OUT/table.md"
import json, subprocess, sys
from pathlib import Path

out = Path(sys.argv[1])
METRICS = {"decode": ("decode_ms_per_token", "ms/token", ".2f"), "prefill": ("prefill_seconds", "s", ".3f")}


def figure(path: Path, key: str):
    try:
        record = json.loads((path / "bench.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None, None
    return record.get(key), record.get("gpu_name") or (record.get("floors") or {}).get("gpu_name")


def head(tree_file: Path) -> str:
    tree = tree_file.read_text().split(":", 1)[0]
    if not (Path(tree) / ".git").exists():  # an exported tree: git would answer for the repository around it
        return Path(tree).name
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return tree


lines: dict[str, list[str]] = {metric: [] for metric in METRICS}
gpus, commits = set(), None
rows = sorted((p for p in out.glob("row*") if (p / "row.txt").is_file()), key=lambda p: int(p.name[3:]))
for row in rows:
    name, metrics = (row / "row.txt").read_text().strip().split("|")
    if commits is None:
        commits = (head(row / "before" / "command.txt"), head(row / "after" / "command.txt"))
    for metric in metrics.split(","):
        key, unit, spec = METRICS[metric]
        before, gpu_b = figure(row / "before", key)
        after, gpu_a = figure(row / "after", key)
        gpus |= {g for g in (gpu_b, gpu_a) if g}
        label = name.replace(" decode + prefill", f" {metric}")
        b = f"{before:{spec}} {unit}" if before is not None else "failed"
        a = f"{after:{spec}} {unit}" if after is not None else "failed"
        ratio = f"{after / before:.3f}" if before and after else "-"
        lines[metric].append(f"| {label} | {b} | {a} | {ratio} |")
print("| row | before | after | ratio (after / before) |\n|---|---:|---:|---:|")
print("\n".join(lines["decode"] + lines["prefill"]))
print(f"\nbefore {commits[0] if commits else '-'}, after {commits[1] if commits else '-'}; "
      f"GPU: {', '.join(sorted(gpus)) or '-'}; records and logs under {out}")
EOF
