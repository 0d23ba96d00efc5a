#!/usr/bin/env bash
# GPU: benchmarks/warmup_steps.py on MLX's CUDA backend at the Qwen3.5-2B shape (random bf16 weights built in memory),
# MTP k=1, batch sizes 1..10, prompts of 16, 300 and 4096 tokens (one growing batch each: does a row's KV span need
# warming too?); one process per run (a process keeps its compiles):
#   off-cold  no warm-up, an empty PTX cache: what the first step at each batch size costs through the engine
#   on-cold   the engine's start-up warm-up (sizes 1-8), an empty PTX cache: the warm-up's cost and the steps after it
#   on-warm   the same, with the PTX cache on-cold left behind: a restart on the same machine
# Writes $OUT/warmup_steps-<run>-gpu.json for each run.
# Staging and the two device calls as gpu_serve.sh describes; call 2:
#   BENCH_COMMIT=<commit> bash benchmarks/gpu_warmup.sh
# Environment: WARMUP_RUNS (default "off-cold on-cold on-warm"; "plain-cold" adds a run without MTP, --mtp-k 0),
# WARMUP_ARGS (extra arguments for every run), WARMUP_PTX_DIR (default /tmp/gpu_warmup/ptx), SITE (default
# /root/site), OUT (default $OUT or benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results}
RUNS=${WARMUP_RUNS:-off-cold on-cold on-warm}
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# on-warm reads what on-cold left there, in this call or a later one on the same machine
PTX=${WARMUP_PTX_DIR:-/tmp/gpu_warmup/ptx}
mkdir -p "$OUT"
status=0
for run in $RUNS; do
  case $run in
    off-cold)   rm -rf "$PTX-off"; args=(--warmup off --ptx-cache-dir "$PTX-off") ;;
    on-cold)    rm -rf "$PTX"; args=(--warmup on --ptx-cache-dir "$PTX") ;;
    on-warm)    args=(--warmup on --ptx-cache-dir "$PTX") ;;  # its JSON's ptx_cache.files_before says how warm
    plain-cold) rm -rf "$PTX-plain"; args=(--warmup on --mtp-k 0 --ptx-cache-dir "$PTX-plain") ;;
    *) echo "gpu_warmup: unknown run $run"; exit 2 ;;
  esac
  echo "== $run"
  $PY benchmarks/warmup_steps.py --shape 2b --max-batch 10 --prompt-tokens 16,300,4096 "${args[@]}" ${WARMUP_ARGS:-} \
      --out "$OUT/warmup_steps-$run-gpu.json" || status=5
done
exit $status
