#!/usr/bin/env bash
# GPU benchmark of batched MTP decoding in the text engine (benchmarks/mtp_decode_bench.py) on MLX's
# CUDA backend, for models/tiny-qwen35-trained (its trained head: real acceptance), in the configuration of
# docs/benchmarks.md: 256 new tokens, k = 1 (no --extra-k), 7 timed rounds.
# Realistic shapes with forced acceptance are benchmarks/gpu_run.sh mtp_shapes.
# Staging and running: benchmarks/README.md ("GPU runs").
#
# Environment: GPU_MTP_BUDGET_S (wall seconds after setup, default 420), GPU_MTP_ARGS (extra
# arguments), SITE, OUT (default benchmarks/results/gpu_mtp). Files: $OUT/mtp_decode_gpu.json, the log.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_mtp}
PY=${PY:-python3}
BUDGET_S=${GPU_MTP_BUDGET_S:-420}
mkdir -p "$OUT"

main() {
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ "$BUDGET_S" -ge 30 ] || { echo "gpu_mtp: GPU_MTP_BUDGET_S=$BUDGET_S is too short"; exit 2; }
t0=$(date +%s)
echo "gpu_mtp: trained tiny model, $BUDGET_S s"
# the JSON is rewritten after every batch size: a run cut by the timeout keeps what it measured
timeout -k 10 "$BUDGET_S" $PY benchmarks/mtp_decode_bench.py --max-tokens 256 --repeats 7 --extra-k "" \
    ${GPU_MTP_ARGS:-} --out "$OUT/mtp_decode_gpu.json" | grep -v '^ '
rc=${PIPESTATUS[0]}
echo "gpu_mtp: rc=$rc after $(( $(date +%s) - t0 )) s"
return $rc
}

main 2>&1 | tee "$OUT/gpu_mtp.log"
exit "${PIPESTATUS[0]}"
