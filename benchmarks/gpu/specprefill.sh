#!/usr/bin/env bash
# GPU SpecPrefill speed (issue 17): benchmarks/specprefill_speed.py on MLX's CUDA backend. A Qwen3.5-9B-shaped target
# and two ~0.5B drafts, random bf16 weights built in memory (no checkpoint on disk): a Qwen3.5-shaped draft
# (qwen35-0.5b: gated delta + attention, as a real Qwen3.5 draft would be) and an attention-only one (attn-0.5b).
# TTFT dense vs SpecPrefill at 8K / 16K / 32K prompt tokens, keep 0.2 and 0.3, with the draft's scoring time
# and the dense prefill time, the ideal 1 / (keep + draft_cost / target_cost) and efficiency = measured / ideal.
# Lengths run in order; what does not fit the budget is skipped and listed in the JSON ("skipped").
# Both models' gated-delta layers run the fused CUDA recurrence (recurrence.py), as the server's text model and
# its SpecPrefill draft do; the JSON's versions.fused_gated_delta says so.
#
# Staging and running: benchmarks/README.md ("GPU runs").
# Writes $OUT/specprefill_speed-gpu.json (points, skipped, versions, commit, device) and
# $OUT/specprefill_speed-gpu.log (nvidia-smi line, progress).
# Environment: SPEC_GPU_BUDGET_S (wall seconds for everything, setup included, default 560),
# SPEC_GPU_LENGTHS (default 8192,16384,32768), SPEC_GPU_DRAFTS (default qwen35-0.5b,attn-0.5b),
# SPEC_GPU_KEEP (default 0.2,0.3), SPEC_GPU_REPEATS (default 3, the median is reported), SITE (default /root/site), OUT (default
# benchmarks/results).
# SPEC_GPU_PROFILE=1 runs benchmarks/specprefill_scoring_profile.py instead: the dense prefill beside the attn-0.5b draft's
# prompt prefill by chunk size (SPEC_GPU_CHUNKS, default 2048,4096,8192,16384), waited for and overlapped, at the first
# of SPEC_GPU_LENGTHS (default 32768); writes $OUT/specprefill_scoring_profile-gpu.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results}
BUDGET_S=${SPEC_GPU_BUDGET_S:-560}
mkdir -p "$OUT"

main() {
t_start=$(date +%s)
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
left=$((BUDGET_S - ($(date +%s) - t_start)))
echo "gpu_specprefill: setup took $((BUDGET_S - left)) s; $left s left"
[ "$left" -gt 60 ] || { echo "gpu_specprefill: no time left"; exit 5; }
if [ "${SPEC_GPU_PROFILE:-0}" = 1 ]; then
  tokens=${SPEC_GPU_LENGTHS:-32768}
  timeout -k 20 "$left" $PY benchmarks/specprefill_scoring_profile.py --tokens "${tokens%%,*}" \
      --chunks "${SPEC_GPU_CHUNKS:-2048,4096,8192,16384}" --out "$OUT/specprefill_scoring_profile-gpu.json"
  return $?
fi
timeout -k 20 "$left" $PY benchmarks/specprefill_speed.py --target-shape qwen35-9b \
    --draft-shapes "${SPEC_GPU_DRAFTS:-qwen35-0.5b,attn-0.5b}" --lengths "${SPEC_GPU_LENGTHS:-8192,16384,32768}" \
    --keep "${SPEC_GPU_KEEP:-0.2,0.3}" --repeats "${SPEC_GPU_REPEATS:-3}" --budget-s $((left - 20)) \
    --out "$OUT/specprefill_speed-gpu.json"
rc=$?
echo "gpu_specprefill: rc=$rc in $(( $(date +%s) - t_start )) s"
return $rc
}

main 2>&1 | tee "$OUT/specprefill_speed-gpu.log"
exit "${PIPESTATUS[0]}"
