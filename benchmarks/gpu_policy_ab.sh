#!/usr/bin/env bash
# GPU A/B of the draft policy on MLX's CUDA backend: benchmarks/policy_ab.py on the trained tiny model
# (plain, always, the adaptive cost model kept across rounds and fresh each round, in lockstep),
# batch 1 / 2 / 4 / 8, 256 new tokens, 7 timed rounds. Staging and the two device calls are those of
# gpu_serve.sh (its header); the second call:
#   call 2, carry [.device-b]:  BENCH_COMMIT=<commit> bash benchmarks/gpu_policy_ab.sh
# Environment: POLICY_AB_ARGS (policy_ab.py's arguments; a CPU check of the script:
#   SITE=/tmp/site PY=.venv/bin/python POLICY_AB_ARGS="--batches 1 --max-tokens 8 --rounds 1" bash benchmarks/gpu_policy_ab.sh
# with an empty /tmp/site/.gpu_serve_staged), POLICY_AB_TIMEOUT_S (default 170), SITE, PY.
# Files under $OUT (default benchmarks/results/gpu_policy_ab): policy_ab_gpu.json, gpu_policy_ab.log.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results/gpu_policy_ab}
mkdir -p "$OUT"

main() {
. benchmarks/gpu_setup.sh || return $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
timeout -k 10 "${POLICY_AB_TIMEOUT_S:-170}" $PY benchmarks/policy_ab.py ${POLICY_AB_ARGS:---batches 1,2,4,8 --max-tokens 256 --rounds 7} \
    --out "$OUT/policy_ab_gpu.json"
}

main 2>&1 | tee "$OUT/gpu_policy_ab.log"
exit "${PIPESTATUS[0]}"
