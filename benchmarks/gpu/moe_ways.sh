#!/usr/bin/env bash
# GPU job at the 35B-A3B shape: the MoE switch's dispatch ways (benchmarks/gpu/moe_ways_check.py: bits and times over
# 8 MoE blocks); with GPU_MOE_AB=1 the engine's steps with the expert kernel in the plan against without
# (decode_variants.py, plain and two-draft MTP steps, batch 1 / 4 / 8); then the MoE MTP criterion (decode_loops.py,
# GPU_MOE_KS drafts, batch 1 / 2 / 4 / 8, forced acceptance 0.8) in GPU_MOE_PROCS processes, each its own build and
# its own measured dispatch.
#
# Staging and running: benchmarks/README.md ("GPU runs").
#
# Environment: GPU_MOE_PROCS (default 1), GPU_MOE_CHECK (1: run the check first, default 1), GPU_MOE_CHECK_ARGS (its
# extra arguments), GPU_MOE_AB (default 0), GPU_MOE_KS (draft counts beside one, default 2), SITE, OUT (default
# benchmarks/results/gpu_moe_ways). Files: $OUT/moe_ways.json, $OUT/variants.json, $OUT/procN.json, their logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_moe_ways}
PY=${PY:-python3}
PROCS=${GPU_MOE_PROCS:-1}
mkdir -p "$OUT"
. benchmarks/gpu_setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 2; }
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
rc=0
if [ "${GPU_MOE_CHECK:-1}" = 1 ]; then
  $PY benchmarks/gpu/moe_ways_check.py ${GPU_MOE_CHECK_ARGS:-} --out "$OUT/moe_ways.json" > "$OUT/moe_ways.log" 2>&1 || rc=1
  grep "moe_ways:" "$OUT/moe_ways.log" | tail -8
fi
if [ "${GPU_MOE_AB:-0}" = 1 ]; then
  $PY benchmarks/decode_variants.py --shape 35b-a3b --options by_expert,by_expert_mtp --draft-tokens 2 --batches 1,4,8 \
      --rounds 6 --out "$OUT/variants.json" > "$OUT/variants.log" 2>&1 || rc=1
  tail -3 "$OUT/variants.log"
fi
for i in $(seq 1 "$PROCS"); do
  $PY benchmarks/decode_loops.py --shapes 35b-a3b --batches "" --loops engine --mtp-batches 1,2,4,8 \
      --mtp-ks "${GPU_MOE_KS:-2}" --dispatch measured --no-cupti --out "$OUT/proc$i.json" > "$OUT/proc$i.log" 2>&1 || rc=1
  grep "MoE dispatch measured\|decode_loops: mtp" "$OUT/proc$i.log" | cut -c1-400
done
exit $rc
