#!/usr/bin/env bash
# GPU A/B of the engine's decode-step options (benchmarks/decode_variants.py), each on against off in one process:
# the gated-delta layers' compiled one-token step (on by default only on the CPU so far) and the MTP step's early
# launch of drafts and verify, at the Qwen3.5-2B and 9B shapes with random bf16 weights, batch 1 / 4 / 8.
# One process per shape, 2B first; each shape's JSON is written after every measurement.
#
# Staging and running: benchmarks/README.md ("GPU runs").
#
# Environment: GPU_VARIANTS_BUDGET_S (wall seconds after setup for all shapes, default 420; 2B gets 40% of it),
# GPU_VARIANTS_SHAPES (default "2b 9b"), GPU_VARIANTS_ARGS (extra arguments for every shape), SITE, OUT (default
# benchmarks/results/gpu_decode_variants). Files: $OUT/decode_variants_<shape>_gpu.json, the log.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_decode_variants}
PY=${PY:-python3}
BUDGET_S=${GPU_VARIANTS_BUDGET_S:-420}
SHAPES=${GPU_VARIANTS_SHAPES:-2b 9b}
mkdir -p "$OUT"

main() {
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
t0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - t0))); }
rc_all=0
n=$(echo $SHAPES | wc -w)
for shape in $SHAPES; do
  n=$((n - 1))
  share=$(( n > 0 ? $(left) * 40 / 100 : $(left) ))
  if [ "$share" -lt 60 ]; then
    echo "gpu_decode_variants: skip $shape ($share s for it)"; rc_all=6; continue
  fi
  echo "gpu_decode_variants: $shape, $share s (of $(left) s left)"
  timeout -k 10 "$share" $PY benchmarks/decode_variants.py --shape "$shape" ${GPU_VARIANTS_ARGS:-} \
      --out "$OUT/decode_variants_${shape}_gpu.json"
  rc=$?
  echo "gpu_decode_variants: $shape rc=$rc after $(( $(date +%s) - t0 )) s"
  [ "$rc" -eq 0 ] || rc_all=$rc
done
return $rc_all
}

main 2>&1 | tee "$OUT/gpu_decode_variants.log"
exit "${PIPESTATUS[0]}"
