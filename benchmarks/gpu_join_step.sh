#!/usr/bin/env bash
# GPU: benchmarks/join_step.py on MLX's CUDA backend at the Qwen3.5-2B shape (random bf16 weights built in
# memory): the decode step a 16K-token row joins, attention in one call vs split by row length (the engine's
# default split), and at a 2K-token row with every split forced (--overhead 1: does a split pay there?).
# Staging and the two device calls as gpu_serve.sh describes; call 2:  BENCH_COMMIT=<commit> bash benchmarks/gpu_join_step.sh
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results}
. benchmarks/gpu_setup.sh || exit $?
mkdir -p "$OUT"
$PY benchmarks/join_step.py --shape 2b --long 16384 --out "$OUT/join_step-gpu.json" || exit 5
$PY benchmarks/join_step.py --shape 2b --long 2048 --overhead 1 --out "$OUT/join_step_2k_forced-gpu.json" || exit 6
