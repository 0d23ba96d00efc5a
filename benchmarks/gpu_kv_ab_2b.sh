#!/usr/bin/env bash
# GPU A/B of the text engine's KV layouts at a realistic shape: a plain decode step and an MTP
# verify step ([B, 2], capture, per-row rollback) of a Qwen3.5-2B-shaped model (random bf16 weights,
# built in memory on the GPU in eval mode), batch 1 / 4 / 8 at 256 tokens of context and batch 4 at
# 2048, for three layouts in one process, paired (benchmarks/kv_layout_ab.py):
#   pool         this checkout (64-token blocks per row; a lone row whose blocks are one run is
#                read as a slice of the pool)
#   pool_gather  this checkout with that slice off (every step gathers, as the pool did before)
#   dense        the commit before issue 12 (d21ce46): one buffer at the longest row's capacity
# then the same on the tiny trained model (launch-bound: the 5-9% of BENCHMARKS.md section 6).
#
# Staging on the workstation: that of gpu_serve.sh (its header), plus the older layout, the one file
# kv_layout_ab.py reads from it (15 KB, so the carried .device-b stays under the copy limit):
#   mkdir -p .device-b/base/vllm_mlx_mtp_routing/text_engine
#   git show d21ce46:vllm_mlx_mtp_routing/text_engine/batch_cache.py \
#       > .device-b/base/vllm_mlx_mtp_routing/text_engine/batch_cache.py
# then two device calls (a machine still warm from another GPU script skips the install):
#   call 1, carry [.device-a]:  cp .device-a/mlx.part.aa /root/
#   call 2, carry [.device-b]:  BENCH_COMMIT=<commit> OUT=$OUT bash benchmarks/gpu_kv_ab_2b.sh
# Files under $OUT (default benchmarks/results/gpu_kv_ab_2b): kv_layout_2b_gpu.json,
# kv_layout_2b_ctx2048_gpu.json, kv_layout_trained_gpu.json, gpu_kv_ab_2b.log. At most ~7 minutes with the install (the runs are capped at 200 + 100 + 90 s).
# Environment: KV_AB_STEPS (timed steps per layout and step kind, default 240), KV_AB_SHAPE (default 2b;
# small: the same run at a tiny shape, a CPU check of the script:
#   SITE=/tmp/site PY=.venv/bin/python KV_AB_SHAPE=small KV_AB_STEPS=8 BASE=/tmp/base bash benchmarks/gpu_kv_ab_2b.sh
# with an empty /tmp/site/.gpu_serve_staged), SITE, PY, BASE, KV_AB_ALT (another batch_cache.py timed beside them as
# "alt", with its package-relative imports made absolute, e.g. the layout before a change:
#   git show <commit>:vllm_mlx_mtp_routing/text_engine/batch_cache.py | sed 's/from \.\./from vllm_mlx_mtp_routing./' > .device-b/alt_bc.py).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results/gpu_kv_ab_2b}
BASE=${BASE:-$REPO/.device-b/base}
STEPS=${KV_AB_STEPS:-240}
SHAPE=${KV_AB_SHAPE:-2b}
mkdir -p "$OUT"

main() {
if [ ! -f "$BASE/vllm_mlx_mtp_routing/text_engine/batch_cache.py" ]; then
  echo "gpu_kv_ab_2b: $BASE/vllm_mlx_mtp_routing/text_engine/batch_cache.py missing (see the staging in this script's header)"
  return 2
fi
. benchmarks/gpu_setup.sh || return $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
rc_all=0
run() {  # timeout seconds, then kv_layout_ab.py's arguments
  local limit=$1; shift
  timeout -k 10 "$limit" $PY benchmarks/kv_layout_ab.py --base "$BASE" ${KV_AB_ALT:+--alt "$KV_AB_ALT"} "$@"
  local rc=$?
  echo "gpu_kv_ab_2b: rc=$rc ($*)"
  [ "$rc" -eq 0 ] || rc_all=$rc
}
echo "== $SHAPE shape, context 256, batch 1/4/8"
run 200 --shape "$SHAPE" --batches 1,4,8 --steps "$STEPS" --block 4 --out "$OUT/kv_layout_${SHAPE}_gpu.json"
echo "== $SHAPE shape, context 2048, batch 4"
run 100 --shape "$SHAPE" --batches 4 --context 2048 --long 0 --steps $((STEPS / 2)) --block 4 --out "$OUT/kv_layout_${SHAPE}_ctx2048_gpu.json"
echo "== tiny trained model, context 256, batch 1/4/8"
run 90 --batches 1,4,8 --long 0 --steps "$STEPS" --block 4 --out "$OUT/kv_layout_trained_gpu.json"
return $rc_all
}

main 2>&1 | tee "$OUT/gpu_kv_ab_2b.log"
exit "${PIPESTATUS[0]}"
