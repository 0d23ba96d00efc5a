#!/usr/bin/env bash
# GPU SpecPrefill scoring profile (issue 38): benchmarks/specprefill_scoring_profile.py on MLX's CUDA backend, the
# 9B-shaped target's dense prefill beside the attn-0.5b draft's prompt prefill at several chunk sizes, synchronous and
# overlapped, and the look-ahead. Writes $OUT/specprefill_scoring_profile-gpu.json and .log.
# Environment: PROFILE_TOKENS (default 32768), PROFILE_CHUNKS (default 2048,4096,8192,16384), PROFILE_DRAFT (default
# attn-0.5b), SITE (default /root/site), OUT (default benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results}
mkdir -p "$OUT"
main() {
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
$PY benchmarks/specprefill_scoring_profile.py --tokens "${PROFILE_TOKENS:-32768}" --chunks "${PROFILE_CHUNKS:-2048,4096,8192,16384}" \
    --draft-shape "${PROFILE_DRAFT:-attn-0.5b}" --out "$OUT/specprefill_scoring_profile-gpu.json"
}
main 2>&1 | tee "$OUT/specprefill_scoring_profile-gpu.log"
exit "${PIPESTATUS[0]}"
