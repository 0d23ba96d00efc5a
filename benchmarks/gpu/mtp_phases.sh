#!/usr/bin/env bash
# Where an MTP step's wall time goes on the GPU (benchmarks/mtp_step_phases.py): plain against MTP, phase by phase,
# at forced acceptance 0.8. Default shape 35B-A3B: all 40 layers on a card of 100 GB or more (an H200), else
# GPU_PHASES_LAYERS of them (default 28).
#
# Staging and running: benchmarks/README.md ("GPU runs").
#
# Environment: GPU_PHASES_SHAPE (default 35b-a3b), GPU_PHASES_BATCHES (default 1,2,4,8), GPU_PHASES_LAYERS,
# GPU_PHASES_BUDGET_S (wall seconds after setup, default 300), GPU_PHASES_ARGS (extra arguments), SITE, OUT (default
# benchmarks/results/gpu_mtp_phases). Files: $OUT/mtp_step_phases_<shape>_gpu.json, the log.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_mtp_phases}
PY=${PY:-python3}
SHAPE=${GPU_PHASES_SHAPE:-35b-a3b}
mkdir -p "$OUT"

main() {
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -d ' ')
layers=0
if [ "$SHAPE" = 35b-a3b ] && [ "${mem_mib:-0}" -lt 100000 ]; then layers=${GPU_PHASES_LAYERS:-28}; fi
timeout -k 10 "${GPU_PHASES_BUDGET_S:-300}" $PY benchmarks/mtp_step_phases.py --shape "$SHAPE" --layers "$layers" \
    --batches "${GPU_PHASES_BATCHES:-1,2,4,8}" ${GPU_PHASES_ARGS:-} --out "$OUT/mtp_step_phases_${SHAPE}_gpu.json"
}

main 2>&1 | tee "$OUT/mtp_phases.log"
exit "${PIPESTATUS[0]}"
