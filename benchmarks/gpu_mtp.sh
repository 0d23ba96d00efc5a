#!/usr/bin/env bash
# GPU benchmark of batched MTP decoding in the text engine (benchmarks/mtp_decode_bench.py) on
# MLX's CUDA backend, for
#   models/tiny-qwen35-trained    (its trained head: real acceptance)        and
#   a Qwen3.5-2B-shaped model     (random bf16 weights, make_qwen35_2b.py; acceptance FORCED with
#                                  --forced-acceptance, its random head accepts nothing)
# Staging and the two device calls are those of gpu_serve.sh (the second call runs this script).
# Read the 2B run for its step costs (t1, t2, tm) only: in bf16 on CUDA its near-tie random logits
# round differently in a [B, 2] verify and a [B, 1] step, the forced "true" continuation stops
# matching, and the acceptance it reaches (0.07 on an H100) says nothing about MTP.
#
# Environment: GPU_MTP_BUDGET_S (wall seconds for everything after setup, default 540),
# GPU_MTP_TRAINED_ARGS / GPU_MTP_2B_ARGS (extra arguments of each run), GPU_MTP_FORCED (default
# 0.8), MODEL_2B (default /root/qwen35-2b), SITE, OUT (default benchmarks/results/gpu_mtp).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_mtp}
PY=${PY:-python3}
BUDGET_S=${GPU_MTP_BUDGET_S:-540}
MODEL_2B=${MODEL_2B:-/root/qwen35-2b}
mkdir -p "$OUT"

main() {
. benchmarks/gpu_setup.sh || exit $?
t0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - t0))); }

echo "gpu_mtp: trained tiny model"
timeout -k 10 "$(( $(left) * 45 / 100 ))" $PY benchmarks/mtp_decode_bench.py --max-tokens 256 --extra-k 2 \
    ${GPU_MTP_TRAINED_ARGS:-} --out "$OUT/mtp_decode_gpu.json" | grep -v '^ ' 
echo "gpu_mtp: trained rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"

if [ ! -e "$MODEL_2B/config.json" ]; then
  $PY benchmarks/make_qwen35_2b.py "$MODEL_2B" || exit 4
fi
echo "gpu_mtp: 2B-shaped model, $(left) s left"
timeout -k 10 "$(left)" $PY benchmarks/mtp_decode_bench.py --model "$MODEL_2B" \
    --forced-acceptance "${GPU_MTP_FORCED:-0.8}" --max-tokens 128 --repeats 3 --extra-k "" --iters 10 \
    ${GPU_MTP_2B_ARGS:-} --out "$OUT/mtp_decode_2b_gpu.json" | grep -v '^ '
echo "gpu_mtp: 2B rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
}

main 2>&1 | tee "$OUT/gpu_mtp.log"
exit "${PIPESTATUS[0]}"
