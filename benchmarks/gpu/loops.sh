#!/usr/bin/env bash
# GPU decode loops (benchmarks/decode_loops.py): the text engine's plain decode step beside mlx-lm 0.31.3's
# generate_step (batch 1) and BatchGenerator (batch 1 / 4 / 8) on one model object, per shape: seconds per step
# (median of 3 blocks), CPU seconds per step, the device's busy time and kernels per step (CUPTI), the bandwidth
# bound; and for the MoE shape, MTP on vs plain at forced acceptance 0.8, batch 1 / 2 / 4 / 8. Shapes: Qwen3.5-2B,
# 9B and 35B-A3B with random bf16 weights built in memory, one process each. The full 35B-A3B (40 layers) needs
# ~72 GB, more than an H100 has: on a card under 100 GB it is built with GPU_LOOPS_MOE_LAYERS of its layers (default
# 28, said in the output); on an H200 with all 40.
#
# Staging and running: benchmarks/README.md ("GPU runs"). The device's busy time needs NVIDIA's cupti-python, which
# the GPU machine lacks (its image has cuda-bindings, cuda-pathfinder and CUDA 13.0's nvidia-cuda-cupti): add
# `cupti-python==13.0.1 pyelftools==0.33` to stage.sh's wheels (cp312 / pure-Python wheels, ~1.1 MB). Without it the
# job runs and says "n/a: cupti-python not importable" where the busy time would be.
#
# Environment: GPU_LOOPS_SHAPES (default "2b 9b 35b-a3b"), GPU_LOOPS_BUDGET_S (wall seconds after setup for all
# shapes, default 420; each shape gets a share, the MoE shape the most), GPU_LOOPS_MOE_LAYERS (the 35B-A3B's layers on
# a card under 100 GB, default 28), GPU_LOOPS_MTP_BATCHES (the MoE shape's MTP batch sizes, default 1,2,4,8; empty
# skips), GPU_LOOPS_ARGS (extra arguments for every shape), SITE, OUT (default benchmarks/results/gpu_loops).
# Files: $OUT/decode_loops_<shape>_gpu.json, the log. All three shapes in one job share the budget (the last batch
# sizes may be skipped, said in the log and the JSON's skipped_batches); for every figure run two jobs,
# GPU_LOOPS_SHAPES="2b 9b" and GPU_LOOPS_SHAPES=35b-a3b.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_loops}
PY=${PY:-python3}
BUDGET_S=${GPU_LOOPS_BUDGET_S:-420}
SHAPES=${GPU_LOOPS_SHAPES:-2b 9b 35b-a3b}
MTP_BATCHES=${GPU_LOOPS_MTP_BATCHES-1,2,4,8}
mkdir -p "$OUT"

main() {
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
. benchmarks/gpu/cupti_env.sh
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -d ' ')
moe_layers=0
if [ "${mem_mib:-0}" -lt 100000 ]; then moe_layers=${GPU_LOOPS_MOE_LAYERS:-28}; fi
t0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - t0))); }
rc_all=0
# each shape's weight in the time left: the MoE shape (its build, and its MTP runs) takes the most
weight() { case $1 in 2b) echo 25;; 9b) echo 30;; *) echo 45;; esac; }
todo=0; for shape in $SHAPES; do todo=$((todo + $(weight $shape))); done
for shape in $SHAPES; do
  w=$(weight $shape)
  share=$(( $(left) * w / todo ))
  todo=$((todo - w))
  if [ "$share" -lt 60 ]; then
    echo "gpu_loops: skip $shape ($share s for it)"; rc_all=6; continue
  fi
  extra=""
  if [ "$shape" = 35b-a3b ]; then
    [ -n "$MTP_BATCHES" ] && extra="--mtp-batches $MTP_BATCHES"
    [ "$moe_layers" -gt 0 ] && extra="$extra --layers $moe_layers" \
        && echo "gpu_loops: 35b-a3b with $moe_layers of its 40 layers (${mem_mib} MiB on the card; the full shape needs ~72 GB)"
  fi
  echo "gpu_loops: $shape, $share s (of $(left) s left)"
  # --budget-s stops starting batch sizes in time; timeout (never 0) is the hard stop
  timeout -k 10 "$share" $PY benchmarks/decode_loops.py --shapes "$shape" --budget-s $((share - 40)) $extra \
      ${GPU_LOOPS_ARGS:-} --out "$OUT/decode_loops_${shape}_gpu.json"
  rc=$?
  echo "gpu_loops: $shape rc=$rc after $(( $(date +%s) - t0 )) s"
  [ "$rc" -eq 0 ] || rc_all=$rc
done
return $rc_all
}

main 2>&1 | tee "$OUT/gpu_loops.log"
exit "${PIPESTATUS[0]}"
