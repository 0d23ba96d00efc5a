#!/usr/bin/env bash
# MLX's CUDA graph settings against the engine's decode step (benchmarks/decode_loops.py, untraced). MLX 0.32's CUDA
# backend adds every kernel to a CUDA graph and commits it every MLX_MAX_OPS_PER_BUFFER nodes (100 on an H100/H200) or
# once the arrays its nodes read pass MLX_MAX_MB_PER_BUFFER (1,000 M elements: an MoE expert gather reads its whole
# expert tensor); MLX_USE_CUDA_GRAPHS=0 launches kernels directly. Each setting is read once per process, so each
# (setting, shape) runs as its own process, settings alternating, GPU_GRAPHS_REPS times: a process's speed drifts
# (a plain 35B-A3B step took 16-26 ms in three processes of one machine), so compare medians over repetitions.
#
# Staging and running: benchmarks/README.md ("GPU runs").
#
# Environment: GPU_GRAPHS_SHAPE (2b or 35b-a3b, default 2b), GPU_GRAPHS_SETTINGS (names below; default all, for
# 35b-a3b the first three),
# GPU_GRAPHS_REPS (default 2), GPU_GRAPHS_BUDGET_S (wall seconds after setup, default 500; no process starts past it),
# GPU_GRAPHS_MOE_LAYERS (35b-a3b's layers on a card under 100 GB, default 28), SITE, OUT (default
# benchmarks/results/gpu_cuda_graphs). Files: $OUT/<setting>_<shape>_<rep>.json, the log, and a summary line per
# setting (the engine's step ms per batch; 35b-a3b: MTP over plain per batch).
#   default       MLX's own settings
#   graphs_off    MLX_USE_CUDA_GRAPHS=0
#   mb_unbounded  MLX_MAX_MB_PER_BUFFER=100000 (commits by node count only)
#   ops_400       MLX_MAX_OPS_PER_BUFFER=400 and MLX_MAX_MB_PER_BUFFER=100000
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_cuda_graphs}
PY=${PY:-python3}
SHAPE=${GPU_GRAPHS_SHAPE:-2b}
# a 35B-A3B process takes ~85 s (its build, the dispatch measurement, MTP at two sizes): three settings twice fit a call
if [ "$SHAPE" = 35b-a3b ]; then default_settings="default graphs_off mb_unbounded"
else default_settings="default graphs_off mb_unbounded ops_400"; fi
SETTINGS=${GPU_GRAPHS_SETTINGS:-$default_settings}
REPS=${GPU_GRAPHS_REPS:-2}
BUDGET_S=${GPU_GRAPHS_BUDGET_S:-500}
mkdir -p "$OUT"

setting_env() {
  case $1 in
    default) echo "";;
    graphs_off) echo "MLX_USE_CUDA_GRAPHS=0";;
    mb_unbounded) echo "MLX_MAX_MB_PER_BUFFER=100000";;
    ops_400) echo "MLX_MAX_OPS_PER_BUFFER=400 MLX_MAX_MB_PER_BUFFER=100000";;
    *) echo "unknown setting $1" >&2; return 2;;
  esac
}

main() {
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
args="--shapes $SHAPE --no-cupti --batches 1,8"
if [ "$SHAPE" = 35b-a3b ]; then
  args="$args --loops engine --mtp-batches 1,8 --mtp-rounds 3 --dispatch measured"
  mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -d ' ')
  [ "${mem_mib:-0}" -lt 100000 ] && args="$args --layers ${GPU_GRAPHS_MOE_LAYERS:-28}"
else
  args="$args --loops engine,batch_generator"
fi
t0=$(date +%s)
last=0
for rep in $(seq 1 "$REPS"); do
  for setting in $SETTINGS; do
    env_vars=$(setting_env "$setting") || return 2
    used=$(( $(date +%s) - t0 ))
    if [ $((used + last)) -gt "$BUDGET_S" ]; then
      echo "gpu_cuda_graphs: skip $setting rep $rep ($used s used, the last process took $last s)"; continue
    fi
    s=$(date +%s)
    echo "gpu_cuda_graphs: $setting ($env_vars) rep $rep"
    env $env_vars timeout -k 10 $((BUDGET_S - used + 60)) $PY benchmarks/decode_loops.py $args \
        --out "$OUT/${setting}_${SHAPE}_${rep}.json" | grep -E "^\| $SHAPE|rc=|Error|error" | head -8
    last=$(( $(date +%s) - s ))
  done
done
$PY - "$OUT" "$SHAPE" <<'PY'
import glob, json, statistics, sys
out, shape = sys.argv[1], sys.argv[2]
by = {}
for f in sorted(glob.glob(f"{out}/*_{shape}_*.json")):
    setting = f.rsplit("/", 1)[1].rsplit(f"_{shape}_", 1)[0]
    d = json.load(open(f))
    for s in d["shapes"]:
        for r in s["rows"]:
            by.setdefault(setting, {}).setdefault(f"engine_b{r['batch']}_ms", []).append(r["engine"]["step_ms"])
        for m in s.get("mtp", []):
            by.setdefault(setting, {}).setdefault(f"mtp_over_plain_b{m['batch']}", []).append(m["speedup"])
for setting, vals in by.items():
    print("gpu_cuda_graphs summary:", setting, {k: round(statistics.median(v), 3) for k, v in sorted(vals.items())},
          {k: v for k, v in sorted(vals.items())})
PY
}

main 2>&1 | tee "$OUT/cuda_graphs.log"
exit "${PIPESTATUS[0]}"
