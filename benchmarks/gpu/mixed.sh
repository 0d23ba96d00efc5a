#!/usr/bin/env bash
# GPU mixed text + image load (benchmarks/mixed_load.py): host alone, host + the plugin and mlx-vlm's own server on
# MLX's CUDA backend, a Qwen3.5-2B-shaped model with random bf16 weights (benchmarks/make_qwen35_2b.py), plugin MTP off
# then on. Staging and running: benchmarks/README.md ("GPU runs"), with mlx-audio==0.6.2, cryptography, cffi and
# pycparser among the staged wheels (mlx-vlm's server imports them).
# Environment: GPU_MIXED_CONFIGS ("plain mtp": the plugin without, then with --enable-mtp), MTP_FORCE_ACCEPTANCE (the
# plugin's verify accepts each draft with this probability: the random head drafts nothing the backbone agrees with),
# GPU_MIXED_LIMIT_S (per configuration, default 240; on a machine's first run the servers' start-up can take most of
# it: stop 50's H100 needed a second call, GPU_MIXED_CONFIGS=plain GPU_MIXED_LIMIT_S=320), GPU_MIXED_ROUNDS (4), GPU_MIXED_TOKENS (128),
# MODEL_2B (default /root/qwen35-2b), SITE, OUT (default benchmarks/results/gpu_mixed).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_mixed}
PY=${PY:-python3}
MODEL_2B=${MODEL_2B:-/root/qwen35-2b}
mkdir -p "$OUT"
. benchmarks/gpu_setup.sh || exit $?
[ -e "$MODEL_2B/config.json" ] || $PY benchmarks/lib/make_qwen35_2b.py "$MODEL_2B" || exit 4
LAUNCH="$PY $REPO/benchmarks/lib/vllm_mlx_launcher.py --site $SITE"
for config in ${GPU_MIXED_CONFIGS:-plain mtp}; do
  mtp=$([ "$config" = mtp ] && echo --mtp)
  name=mixed_2b${mtp:+_mtp}
  timeout -k 20 ${GPU_MIXED_LIMIT_S:-240} $PY benchmarks/mixed_load.py --model "$MODEL_2B" --rounds ${GPU_MIXED_ROUNDS:-4} \
      --max-tokens ${GPU_MIXED_TOKENS:-128} $mtp --server-cmd "$LAUNCH" --out "$OUT/$name.json" 2>&1 | tail -12 | tee "$OUT/$name.txt"
done
