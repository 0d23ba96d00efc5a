#!/usr/bin/env bash
# GPU checks of the text model's CUDA kernels: the fused gated-delta recurrence against mlx-lm's loop (exactness
# properties and time per call, recurrence_check.py), the 2B-shaped model's prefill and steps with each recurrence
# (fused_prefill.py), the few-row matmul against MLX's own (skinny_matmul_bench.py), and the conv's one-kernel step
# against the concatenation it replaces (conv_step_check.py), and the gated-delta layer's one kernel against the ops
# (agreement, its exactness properties, time per call: layer_check.py).
# Staging and running: benchmarks/README.md ("GPU runs").
# Environment: SITE (default /root/site), MODEL_2B (default /root/qwen35-2b), OUT (default benchmarks/results/gpu_kernels).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results/gpu_kernels}
MODEL_2B=${MODEL_2B:-/root/qwen35-2b}
mkdir -p "$OUT"

main() {
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ -e "$MODEL_2B/config.json" ] || $PY benchmarks/lib/make_qwen35_2b.py "$MODEL_2B" || exit 4
rc=0
$PY benchmarks/gpu/recurrence_check.py --out "$OUT/recurrence_check-gpu.json" || rc=$?
$PY benchmarks/gpu/fused_prefill.py --model "$MODEL_2B" --out "$OUT/fused_prefill_2b-gpu.json" || rc=$?
$PY benchmarks/gpu/skinny_matmul_bench.py --out "$OUT/skinny_matmul-gpu.json" || rc=$?
$PY benchmarks/gpu/conv_step_check.py --out "$OUT/conv_step_check-gpu.json" || rc=$?
$PY benchmarks/gpu/layer_check.py --out "$OUT/layer_check-gpu.json" || rc=$?
return $rc
}

main 2>&1 | tee "$OUT/gpu_kernels.log"
exit "${PIPESTATUS[0]}"
