#!/usr/bin/env bash
# The 2B step's CPU at batch 1 (benchmarks/decode_loops.py, the engine beside mlx-lm's generate_step): GPU_CPU_STEP_REPS
# processes untraced and as many traced by CUPTI (how the issue's 8.6 ms was read), alternated, one process each: a
# process's speed drifts, so compare the medians. Prints a line per process and a summary: the engine's process CPU
# per step, its main thread's, generate_step's, and the engine over generate_step.
#
# Staging and running: benchmarks/README.md ("GPU runs").
#
# Environment: GPU_CPU_STEP_REPS (default 3), GPU_CPU_STEP_REPEATS (decode_loops --repeats, default 5),
# GPU_CPU_STEP_BUDGET_S (wall seconds after setup, default 500; no process starts past it), SITE, OUT (default
# benchmarks/results/gpu_cpu_step). Files: $OUT/{untraced,traced}_<rep>.json, the processes' output
# (processes.log) and this job's log: eight files at the default three repetitions.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_cpu_step}
PY=${PY:-python3}
REPS=${GPU_CPU_STEP_REPS:-3}
BUDGET_S=${GPU_CPU_STEP_BUDGET_S:-500}
mkdir -p "$OUT"

main() {
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
. benchmarks/gpu/cupti_env.sh
args="--shapes 2b --batches 1 --loops engine,generate_step --repeats ${GPU_CPU_STEP_REPEATS:-5}"
t0=$(date +%s)
last=0
for rep in $(seq 1 "$REPS"); do
  for mode in untraced traced; do
    used=$(( $(date +%s) - t0 ))
    if [ $((used + last)) -gt "$BUDGET_S" ]; then
      echo "gpu_cpu_step: skip $mode rep $rep ($used s used, the last process took $last s)"; continue
    fi
    flag=""; [ "$mode" = untraced ] && flag="--no-cupti"
    s=$(date +%s)
    timeout -k 10 $((BUDGET_S - used + 60)) $PY benchmarks/decode_loops.py $args $flag \
        --out "$OUT/${mode}_${rep}.json" >> "$OUT/processes.log" 2>&1
    echo "gpu_cpu_step: $mode rep $rep rc=$? in $(( $(date +%s) - s )) s"
    last=$(( $(date +%s) - s ))
  done
done
$PY - "$OUT" <<'PY'
import glob, json, statistics, sys
by = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/*_*.json")):
    mode = f.rsplit("/", 1)[1].split("_")[0]
    row = json.load(open(f))["shapes"][0]["rows"][0]
    e, g = row["engine"], row["generate_step"]
    r = (e["cpu_ms"], e["thread_cpu_ms"], g["cpu_ms"], e["cpu_ms"] / g["cpu_ms"], e.get("device_busy_ms"), e.get("kernels_per_step"))
    by.setdefault(mode, []).append(r)
    print(f"gpu_cpu_step: {f.rsplit('/', 1)[1]} engine cpu {r[0]:.2f} ms (main thread {r[1]:.2f}), "
          f"generate_step cpu {r[2]:.2f} ms, ratio {r[3]:.3f}, step {e['step_ms']:.2f} ms, busy {r[4]}, kernels {r[5]}")
for mode, rs in by.items():
    print(f"gpu_cpu_step summary {mode}: n={len(rs)} engine cpu median {statistics.median(x[0] for x in rs):.2f} ms, "
          f"main thread {statistics.median(x[1] for x in rs):.2f}, generate_step {statistics.median(x[2] for x in rs):.2f}, "
          f"ratio median {statistics.median(x[3] for x in rs):.3f}")
PY
}

main 2>&1 | tee "$OUT/cpu_step.log"
exit "${PIPESTATUS[0]}"
