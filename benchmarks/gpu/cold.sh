#!/usr/bin/env bash
# GPU cold long prompts (benchmarks/cold_ttft.py): a lone prompt, nothing cached, host alone against host + plugin, both
# up at once, alternated, on MLX's CUDA backend with a Qwen3.5-2B-shaped model (random bf16 weights).
# Environment: GPU_COLD_TOKENS ("10000 27000"), GPU_COLD_ROUNDS (3), GPU_COLD_LIMIT_S (420), MODEL_2B
# (default /root/qwen35-2b), SITE, OUT (default benchmarks/results/gpu_cold).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_cold}
PY=${PY:-python3}
MODEL_2B=${MODEL_2B:-/root/qwen35-2b}
mkdir -p "$OUT"
. benchmarks/gpu_setup.sh || exit $?
[ -e "$MODEL_2B/config.json" ] || $PY benchmarks/lib/make_qwen35_2b.py "$MODEL_2B" || exit 4
LAUNCH="$PY $REPO/benchmarks/lib/vllm_mlx_launcher.py --site $SITE"
timeout -k 20 ${GPU_COLD_LIMIT_S:-420} $PY benchmarks/cold_ttft.py --model "$MODEL_2B" \
    --prompt-tokens ${GPU_COLD_TOKENS:-10000 27000} --rounds ${GPU_COLD_ROUNDS:-3} --server-cmd "$LAUNCH" \
    --out "$OUT/cold_ttft_2b.json" 2>&1 | tail -12 | tee "$OUT/cold_ttft_2b.txt"
