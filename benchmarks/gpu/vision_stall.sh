#!/usr/bin/env bash
# GPU vision-tower stall (benchmarks/vision_stall.py): running streams while an image request's vision tower runs, the
# tower in pieces of its blocks against one call, on MLX's CUDA backend. A tiny VLM (bf16) with a Qwen3.5-sized
# tower (24 blocks of width 1024) and images past the tiny processor's pixel cap (729 tokens at 1024x1024), then the
# CPU benchmark's 12 x 256 tower. Each model is built on the machine once (/root/vision-stall-*); the build and the
# engine's calibration take most of a first run, so each configuration gets its own limit and prints as it ends.
# Environment: GPU_VISION_CONFIGS (comma-separated "depth width streams image-size max-pixels", default both),
# GPU_VISION_LIMIT_S (per configuration, default 240), GPU_VISION_ROUNDS (6), SITE, OUT (default
# benchmarks/results/gpu_vision_stall).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_vision_stall}
PY=${PY:-python3}
mkdir -p "$OUT"
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
rc=0
IFS=, read -ra configs <<< "${GPU_VISION_CONFIGS:-24 1024 4 1024 786432,12 256 2 224 0}"
for config in "${configs[@]}"; do
  set -- $config
  name=vision_stall_${1}x${2}
  timeout -k 10 ${GPU_VISION_LIMIT_S:-240} $PY benchmarks/vision_stall.py --depth "$1" --vision-hidden "$2" \
      --dtype bfloat16 --streams "$3" --image-size "$4" --max-pixels "$5" --rounds ${GPU_VISION_ROUNDS:-6} \
      --model "/root/vision-stall-$1x$2" --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  [ $? -eq 0 ] || rc=1
  tail -8 "$OUT/$name.txt"
done
exit $rc
