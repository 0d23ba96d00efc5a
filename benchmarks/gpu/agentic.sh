#!/usr/bin/env bash
# GPU agentic benchmark (benchmarks/agentic_bench.py) on MLX's CUDA backend: the host alone vs the host +
# `--plugins mtp-routing` (prefix cache on), both up at once, for a Qwen3.5-2B-shaped model with random bf16
# weights built here (benchmarks/lib/make_qwen35_2b.py): 3 concurrent conversations sharing a ~4K-token system +
# tools prefix, a tool result or a user message per turn; per turn prompt / reused / prefilled tokens and TTFT.
# mlx-lm's own server is not run here (it needs mlx-lm 0.32.x staged beside the host's 0.31.3).
#
# Staging and running: benchmarks/README.md ("GPU runs").
#
# Environment: GPU_AGENTIC_BUDGET_S (wall seconds for everything, setup included, default 420),
# GPU_AGENTIC_TURNS (default 8), GPU_AGENTIC_CONVERSATIONS (default 3), GPU_AGENTIC_SYSTEM_TOKENS (default 4000),
# GPU_AGENTIC_SERVERS (default host,plugin), SITE (default /root/site), MODEL_2B (default /root/qwen35-2b),
# OUT (default benchmarks/results/gpu_agentic). The last stdout line is the benchmark's JSON summary.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_agentic}
PY=${PY:-python3}
BUDGET_S=${GPU_AGENTIC_BUDGET_S:-420}
MODEL_2B=${MODEL_2B:-/root/qwen35-2b}
mkdir -p "$OUT"

main() {
t_start=$(date +%s)
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ ! -e "$MODEL_2B/config.json" ]; then
  $PY benchmarks/lib/make_qwen35_2b.py "$MODEL_2B" || exit 4
fi
left=$((BUDGET_S - ($(date +%s) - t_start)))
echo "gpu_agentic: setup took $((BUDGET_S - left)) s; $left s left for the benchmark"
[ "$left" -gt 60 ] || { echo "gpu_agentic: no time left"; exit 5; }
# On the time limit the benchmark keeps the turns every server finished ("interrupted": true).
timeout -k 20 "$left" $PY benchmarks/agentic_bench.py --model "$MODEL_2B" \
    --servers "${GPU_AGENTIC_SERVERS:-host,plugin}" --turns "${GPU_AGENTIC_TURNS:-8}" \
    --conversations "${GPU_AGENTIC_CONVERSATIONS:-3}" --system-tokens "${GPU_AGENTIC_SYSTEM_TOKENS:-4000}" \
    --server-cmd "$PY $REPO/benchmarks/lib/vllm_mlx_launcher.py --site $SITE" --out "$OUT/agentic_2b_gpu.json" &
tpid=$!
wait $tpid
rc=$?
kill -9 -- "-$tpid" 2>/dev/null
echo "gpu_agentic: rc=$rc in $(( $(date +%s) - t_start )) s"
return $rc
}

main 2>&1 | tee "$OUT/gpu_agentic.log"
exit "${PIPESTATUS[0]}"
