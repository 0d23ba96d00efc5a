#!/usr/bin/env bash
# GPU SpecPrefill stall benchmark: benchmarks/specprefill_stall.py on MLX's CUDA backend, on the Qwen3.5-2B-shaped
# model with random bf16 weights (benchmarks/make_qwen35_2b.py): 4 streams decoding while one 16K-token prompt is
# prefilled densely (specprefill: false), then scored and sparse-prefilled (keep 0.2), on one server at
# --prefill-step-size 2048. Target (issue 17): longest gap sparse <= 2x dense. Also reports TTFT dense vs sparse.
#
# Staging as gpu_serve.sh describes (MLX halves, host wheels, the plugin's wheel); then one device call:
#   call, carry [.device-b]:  BENCH_COMMIT=<commit> bash benchmarks/gpu_specprefill_stall.sh
# Environment: DRAFT (a draft checkpoint; default: a random 2-layer draft with the model's tokenizer, built here),
# STALL_PROMPT_TOKENS (default 16384), SITE (default /root/site), OUT (default $OUT or benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results}
MODEL_2B=${MODEL_2B:-/root/qwen35-2b}
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ -e "$MODEL_2B/config.json" ] || $PY benchmarks/make_qwen35_2b.py "$MODEL_2B" || exit 4
draft=()
[ -n "${DRAFT:-}" ] && draft=(--draft "$DRAFT")
mkdir -p "$OUT"
$PY benchmarks/specprefill_stall.py --model "$MODEL_2B" "${draft[@]}" --prompt-tokens "${STALL_PROMPT_TOKENS:-16384}" \
    --keep-pct 0.2 --command "$PY $REPO/benchmarks/vllm_mlx_launcher.py --site $SITE" --out "$OUT/specprefill_stall-gpu.json"
