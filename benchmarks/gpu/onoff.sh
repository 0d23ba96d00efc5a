#!/usr/bin/env bash
# GPU: the adaptive MTP schedule through the server, on/off side by side (the plugin with
# --enable-mtp against the plugin without it), for the adaptive default and for --mtp-schedule always.
# Staging and running: benchmarks/README.md ("GPU runs").
# Environment: ONOFF_SCHEDULES (default "adaptive always"),
# ONOFF_REQS (serve_bench --requests-per-slot, default 3), ONOFF_INTERLEAVE (serve_bench --interleave:
# both servers up at once, N alternating rounds each; default 0, one server after the other), SITE, OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD SITE=${SITE:-/root/site} PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results/gpu_onoff}
mkdir -p "$OUT"
. benchmarks/gpu_setup.sh || exit $?
for sched in ${ONOFF_SCHEDULES:-adaptive always}; do
  timeout -k 5 220 $PY benchmarks/serve_bench.py --model trained --no-mtp --no-mixed --warmup-all \
      --concurrency 1,2,4,8 --max-tokens 128 --requests-per-slot "${ONOFF_REQS:-3}" --interleave "${ONOFF_INTERLEAVE:-0}" \
      --server-cmd "$PY $REPO/benchmarks/lib/vllm_mlx_launcher.py --site $SITE" --out-dir "$OUT" \
      --name "serve_onoff_$sched" "--host-flags=--plugins mtp-routing" \
      "--plugin-flags=--enable-mtp --mtp-schedule $sched" 2>&1 | tail -25
done
