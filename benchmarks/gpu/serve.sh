#!/usr/bin/env bash
# GPU serving benchmark: the real `vllm-mlx serve --continuous-batching --mllm` on MLX's CUDA
# backend, host alone vs host + `--plugins mtp-routing` (benchmarks/serve_bench.py), for
#   models/tiny-qwen35-trained                and
#   a Qwen3.5-2B-shaped model, random bf16 weights, built here (benchmarks/lib/make_qwen35_2b.py),
# without and (as time allows) with --enable-mtp. Text workload only by default (GPU_SERVE_MIXED=1
# adds the mixed text+image round).
#
# Staging and running: benchmarks/README.md ("GPU runs").
#
# Environment: GPU_SERVE_WARMUP_ALL (default 1: serve_bench --warmup-all, every batch size once
# before measuring; an older recorded run predates it),
# GPU_SERVE_BUDGET_S (wall seconds for the benchmarks after setup, default 420),
# GPU_SERVE_RUNS (default "2b_nomtp trained_nomtp trained_mtp 2b_mtp", in that order),
# GPU_SERVE_CONCURRENCY (default 1,2,4,8), GPU_SERVE_MAX_TOKENS (default 96), SITE (default /root/site),
# OUT (where results go; default benchmarks/results/gpu_serve). The last stdout line is a JSON summary.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
OUT=${OUT:-$REPO/benchmarks/results/gpu_serve}
PY=${PY:-python3}
BUDGET_S=${GPU_SERVE_BUDGET_S:-420}
RUNS=${GPU_SERVE_RUNS:-2b_nomtp trained_nomtp trained_mtp 2b_mtp}
CONC=${GPU_SERVE_CONCURRENCY:-1,2,4,8}
MAX_TOKENS=${GPU_SERVE_MAX_TOKENS:-96}
MODEL_2B=${MODEL_2B:-/root/qwen35-2b}
WORK=$(mktemp -d /tmp/gpu_serve.XXXXXX)
mkdir -p "$OUT" "$WORK/results"

main() {
t_start=$(date +%s)

. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
LAUNCH="$PY $REPO/benchmarks/lib/vllm_mlx_launcher.py --site $SITE"
$PY -c "import mlx.core as mx, mlx_lm, mlx_vlm, vllm_mlx.server, vllm_mlx_mtp_routing.plugin as p; \
print('mlx', mx.__version__, mx.default_device(), 'plugin from', p.__file__)" || exit 3

if [ ! -e "$MODEL_2B/config.json" ]; then
  $PY benchmarks/lib/make_qwen35_2b.py "$MODEL_2B" || exit 4
fi
t_bench=$(date +%s)
echo "gpu_serve: setup took $((t_bench - t_start)) s; benchmark budget ${BUDGET_S} s; runs: $RUNS"

mixed=--no-mixed
[ "${GPU_SERVE_MIXED:-0}" = 1 ] && mixed=
warmup=--warmup-all
[ "${GPU_SERVE_WARMUP_ALL:-1}" = 1 ] || warmup=
done_runs=()
skipped=()
for run in $RUNS; do
  case $run in
    2b_nomtp)      model=$MODEL_2B; mtp=--no-mtp; need=120; stem=serve_bench_2b_nomtp_gpu ;;
    2b_mtp)        model=$MODEL_2B; mtp=;         need=150; stem=serve_bench_2b_gpu ;;
    trained_nomtp) model=trained;   mtp=--no-mtp; need=60;  stem=serve_bench_nomtp_gpu ;;
    trained_mtp)   model=trained;   mtp=;         need=90;  stem=serve_bench_gpu ;;
    *) echo "gpu_serve: unknown run $run"; continue ;;
  esac
  left=$((BUDGET_S - ($(date +%s) - t_bench)))
  if [ "$left" -lt "$need" ]; then
    echo "gpu_serve: skip $run ($left s left, wants $need)"; skipped+=("$run"); continue
  fi
  echo "gpu_serve: run $run (limit $left s)"
  t0=$(date +%s)
  # timeout signals serve_bench's whole process group, its server included; on SIGTERM serve_bench
  # still writes the rounds it finished (the config is marked "interrupted")
  timeout -k 20 "$left" $PY benchmarks/serve_bench.py --model "$model" $mtp $mixed $warmup --concurrency "$CONC" \
      --max-tokens "$MAX_TOKENS" --server-cmd "$LAUNCH" --out-dir "$WORK/results" --name "$stem" \
      > "$WORK/$stem.stdout" &
  tpid=$!
  wait $tpid
  rc=$?
  kill -9 -- "-$tpid" 2>/dev/null  # timeout leads its own process group: no server outlives its run
  echo "gpu_serve: $run rc=$rc in $(( $(date +%s) - t0 )) s"
  if [ -e "$WORK/results/$stem.json" ]; then
    cp "$WORK/results/$stem.json" "$OUT/"
    done_runs+=("$stem")
  fi
done

# $OUT comes back as at most 8 files: the JSONs, one Markdown of all tables, the log, the rest packed.
for stem in "${done_runs[@]}"; do
  echo "## $stem"; echo; cat "$WORK/results/$stem.md"; echo
done > "$OUT/gpu_serve.md"
tar -C "$WORK/results" -czf "$OUT/gpu_serve_results.tar.gz" .
$PY - "$OUT" "${skipped[*]:-}" "$((t_bench - t_start))" "$(( $(date +%s) - t_bench ))" "${done_runs[@]}" <<'EOF'
import json, sys
from pathlib import Path
out, skipped, stems = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[5:]
setup_s, bench_s = int(sys.argv[3]), int(sys.argv[4])
summary = {"setup_s": setup_s, "bench_s": bench_s, "skipped": skipped, "runs": {}}
for stem in stems:
    r = json.loads((out / f"{stem}.json").read_text())
    summary["device"], summary["commit"] = r["device"], r["commit"]
    summary["runs"][stem] = {
        "model": r["model"], "flags": r["configs"][0]["flags"] if r["configs"] else None,
        "interrupted": [c["name"] for c in r["configs"] if c.get("interrupted")],
        "configs": {c["name"]: c.get("failed", "")[-300:] or {k: [round(s["aggregate_tok_s"] or 0, 1),
                    round(s["decode_tok_s_per_request_mean"] or 0, 1), round(s["ttft_p50_s"] or 0, 3), s["errors"]]
                    for k, s in c["text"].items()} for c in r["configs"]},
        "ratios_agg": {k: round(v["aggregate_tok_s"] or 0, 2)
                       for k, v in (r.get("ratios") or {}).get("text", {}).items()},
        "mtp_acceptance": {c["name"]: c.get("mtp_acceptance") for c in r["configs"]},
    }
summary["legend"] = "per concurrency: [aggregate tok/s, decode tok/s per request, TTFT p50 s, errors]"
print(json.dumps(summary))
EOF
}

main 2>&1 | tee "$OUT/gpu_serve.log"
exit "${PIPESTATUS[0]}"
