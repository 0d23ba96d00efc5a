#!/usr/bin/env bash
# GPU A/B of the text engine's KV layout and MTP speedups against an older checkout, on MLX's CUDA
# backend. Staging and the two device calls are those of gpu_serve.sh; the older checkout's
# vllm_mlx_mtp_routing/ and benchmarks/ travel in .device-b/base/. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results/gpu_kv_ab}
BASE=${BASE:-$REPO/.device-b/base}
mkdir -p "$OUT"
. benchmarks/gpu_setup.sh || exit $?
echo "== KV layouts (pool: this checkout, dense: $BASE), one process"
timeout -k 5 150 $PY benchmarks/kv_layout_ab.py --base "$BASE" --steps 240 --block 4 --out "$OUT/kv_layout_gpu.json"
timeout -k 5 60 $PY benchmarks/kv_layout_ab.py --base "$BASE" --batches 4 --context 2048 --steps 120 --block 4 \
    --out "$OUT/kv_layout_gpu_ctx2048.json" | grep "^B="
for round in 1 2; do
  for side in new base; do
    if [ $side = new ]; then root=$REPO; else root=$BASE; fi
    echo "== mtp_decode_bench --quick: $side (round $round)"
    PYTHONPATH=$root:$SITE timeout -k 5 100 $PY "$root/benchmarks/mtp_decode_bench.py" --quick --extra-k "" \
        --model "$REPO/models/tiny-qwen35-trained" --out "$OUT/mtp_quick_${side}_$round.json" | grep -v '^ ' | tail -4
  done
done
