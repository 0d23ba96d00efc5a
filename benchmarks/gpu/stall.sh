#!/usr/bin/env bash
# GPU stall benchmark: benchmarks/prefill_stall.py on MLX's CUDA backend, on a Qwen3.5-2B-shaped model with
# random bf16 weights (benchmarks/lib/make_qwen35_2b.py): 4 streams decoding while a 16K-token prompt prefills, the
# plugin at a baseline commit ("before", from .device-b/base) against this checkout ("after"), each server
# given STALL_ROUNDS long prompts in a row (default 3; the first pays the one-off CUDA compiles at its row's
# join, the later ones show the steady state: "later_rounds" in the JSON; each server compiles into a PTX cache
# of its own). Then STALL_PREP_PROBES rounds
# (default 10) alternating between the servers of a 16K prompt answered 400 after its preparation (no prefill):
# what the request's template, tokenization and snapshot positions cost the streams ("prep_probes").
#
# Staging and running: benchmarks/README.md ("GPU runs").
# Environment: STALL_PROMPT_TOKENS (default 16384), STALL_ROUNDS, STALL_PREP_PROBES, SITE (default /root/site),
# STALL_WARM_TOKENS (default 300: tokens per stream before the long prompt, past the engine's 256-step window of
# slowest_steps, so that each round reports its own), OUT (default $OUT or benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results}
MODEL_2B=${MODEL_2B:-/root/qwen35-2b}
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ -e "$MODEL_2B/config.json" ] || $PY benchmarks/lib/make_qwen35_2b.py "$MODEL_2B" || exit 4
base=()
[ -d .device-b/base/vllm_mlx_mtp_routing ] && base=(--base "$REPO/.device-b/base")
mkdir -p "$OUT"
$PY benchmarks/prefill_stall.py --model "$MODEL_2B" "${base[@]}" --prompt-tokens "${STALL_PROMPT_TOKENS:-16384}" --warm-tokens "${STALL_WARM_TOKENS:-300}" \
    --rounds "${STALL_ROUNDS:-3}" --prep-probes "${STALL_PREP_PROBES:-10}" --fresh-ptx-cache \
    --command "$PY $REPO/benchmarks/lib/vllm_mlx_launcher.py --site $SITE" --out "$OUT/prefill_stall-gpu.json"
