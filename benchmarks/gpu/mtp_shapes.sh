#!/usr/bin/env bash
# GPU benchmark of MTP decoding in the text engine at realistic shapes (benchmarks/mtp_shapes_bench.py):
# Qwen3.5-2B- and 9B-shaped text models with random bf16 weights built in memory on the GPU (nothing on
# disk), acceptance forced to a = 0.6 / 0.8 / 0.9, batch 1 / 2 / 4 / 8: t1, t2 (each gated-delta
# recurrence, before/after in one run), tm, measured speedup, ideal, efficiency, per-row vs
# all-or-nothing, where t2 - t1 sits, and (2B) a 3072-token prompt's prefill without MTP, with it, and with
# the head over every prompt position (the former way).
# One process per shape, 2B first; each shape's JSON is written after every batch size.
#
# Staging and running: benchmarks/README.md ("GPU runs").
#
# Environment: GPU_SHAPES_BUDGET_S (wall seconds after setup for all shapes, default 400; 2B gets 40%
# of it, the rest goes to 9B), GPU_SHAPES (default "2b 9b"), GPU_SHAPES_ARGS (extra arguments for
# every shape), GPU_SHAPES_PREFILL_TOKENS (2B's prefill prompt, default 3072; 0 skips), SITE, OUT
# (default benchmarks/results/gpu_mtp_shapes). Files: $OUT/mtp_shapes_<shape>_gpu.json, the log.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_mtp_shapes}
PY=${PY:-python3}
BUDGET_S=${GPU_SHAPES_BUDGET_S:-400}
SHAPES=${GPU_SHAPES:-2b 9b}
PREFILL=${GPU_SHAPES_PREFILL_TOKENS:-3072}
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
  # the shapes after this one keep 60% of what is left (the 9B step costs ~2x the 2B's)
  share=$(( n > 0 ? $(left) * 40 / 100 : $(left) ))
  if [ "$share" -lt 60 ]; then
    echo "gpu_mtp_shapes: skip $shape ($share s for it)"; rc_all=6; continue
  fi
  extra=""
  [ "$shape" = 2b ] && [ "$PREFILL" -gt 0 ] && extra="--prefill-tokens $PREFILL"
  echo "gpu_mtp_shapes: $shape, $share s (of $(left) s left)"
  # --budget-s stops starting batch sizes in time; timeout (never 0) is the hard stop
  timeout -k 10 "$share" $PY benchmarks/mtp_shapes_bench.py --shape "$shape" --budget-s $((share - 20)) $extra \
      ${GPU_SHAPES_ARGS:-} --out "$OUT/mtp_shapes_${shape}_gpu.json"
  rc=$?
  echo "gpu_mtp_shapes: $shape rc=$rc after $(( $(date +%s) - t0 )) s"
  [ "$rc" -eq 0 ] || rc_all=$rc
done
return $rc_all
}

main 2>&1 | tee "$OUT/gpu_mtp_shapes.log"
exit "${PIPESTATUS[0]}"
