#!/usr/bin/env bash
# GPU SpecPrefill quality on a long-context pair (issue 38), in one call: tokenize the standard library
# (training/train_long_context.py prepare), train a 15.5M Qwen3.5-shaped target and its 1.8M draft together, with
# tied embeddings, first on 64-token windows made of retrieval pairs (where the copy forms), then on windows of code
# with pairs mixed in, 256, 1024 and 4096 tokens (the curriculum; each phase a share of the time left after the first
# step), then benchmarks/specprefill_retrieval.py on the pair: dense vs SpecPrefill at keep 0.2 / 0.3 / 0.5 vs the
# most recent tokens, plus whole spans, dense ends and the target scoring itself, on held-out text.
#
# Staging and running: benchmarks/README.md ("GPU runs").
# Writes under $OUT: specprefill_lc.log (everything printed), corpus_meta.json, train_log.json (steps, ms/step,
# the loss curve with the answers' teacher-forced accuracy, held-out retrieval of both models),
# specprefill_retrieval-gpu.json (the quality table: "summary"; per-prompt rows), specprefill_retrieval-gpu.md (the
# docs table, filled), and with SPEC_LC_WEIGHTS=1 the pair's weights (lc-run/target, lc-run/draft: fp32 shards).
# Environment: SPEC_LC_BUDGET_S (wall seconds for everything, setup included, default 590), SPEC_LC_EVAL_S (seconds
# kept for the quality run, default 180), SPEC_LC_TRAIN_ARGS (train arguments, default "--tie"; e.g. "--tie --steps
# 1301,161,284,234" repeats a logged run: train_log.json's "reproduce"), SPEC_LC_EVAL_ARGS (extra
# specprefill_retrieval.py arguments, e.g. "--prompts 96"), SPEC_LC_CURRICULUM (train phases
# SEQxBATCH[@PAIRS_PER_1K]:SHARE, default 64x128@80:0.4,256x64:0.1,1024x16:0.2,4096x4:0.3), SPEC_LC_HELDOUT_S (seconds
# kept for a retrieval-only pass with held-out keys and values, --pairs heldout: specprefill_retrieval_heldout-gpu.json;
# default 0, none), SPEC_LC_WEIGHTS (1: weights under $OUT), SPEC_LC_COMPILE (1: mx.compile the training step), SITE
# (default /root/site), OUT (default benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results}
BUDGET_S=${SPEC_LC_BUDGET_S:-590}
EVAL_S=${SPEC_LC_EVAL_S:-180}
DATA=${SPEC_LC_DATA:-/tmp/specprefill_lc/data}
RUN=/tmp/specprefill_lc/run
[ "${SPEC_LC_WEIGHTS:-0}" = 1 ] && RUN=$OUT/lc-run
mkdir -p "$OUT" "$DATA"

main() {
t_start=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - t_start))); }
. benchmarks/gpu_setup.sh || exit $?
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "specprefill_lc: setup done, $(left) s left"
if [ ! -e "$DATA/corpus.npz" ]; then
  TOKENIZERS_PARALLELISM=true $PY training/train_long_context.py prepare --out "$DATA" --train-tokens 8000000 \
      --heldout-tokens 1000000 || exit 4
fi
cp "$DATA/corpus_meta.json" "$OUT/" 2>/dev/null
train_s=$(( $(left) - EVAL_S - 20 ))
echo "specprefill_lc: corpus ready, $(left) s left; training for $train_s s"
[ "$train_s" -gt 60 ] || { echo "specprefill_lc: no time left to train"; exit 5; }
# The training stops itself at its budget (the timeout only guards the call). Uncompiled by default: mx.compile's
# first step costs minutes of kernel JIT (~170 s for the 10M model at 256 tokens).
compile=--no-compile
[ "${SPEC_LC_COMPILE:-0}" = 1 ] && compile=
# shellcheck disable=SC2086
timeout -k 10 $(( $(left) - 15 )) $PY training/train_long_context.py train --data "$DATA" --out "$RUN" \
    --time-budget "$train_s" --curriculum "${SPEC_LC_CURRICULUM:-64x128@80:0.4,256x64:0.1,1024x16:0.2,4096x4:0.3}" \
    $compile ${SPEC_LC_TRAIN_ARGS:---tie} || exit 6
cp "$RUN/train_log.json" "$OUT/"
heldout_s=${SPEC_LC_HELDOUT_S:-0}
eval_s=$(( $(left) - 10 - heldout_s ))
echo "specprefill_lc: trained, $eval_s s for the quality run"
# shellcheck disable=SC2086
timeout -k 10 "$eval_s" $PY benchmarks/specprefill_retrieval.py --run "$RUN" --data "$DATA" --budget-s $((eval_s - 15)) \
    --out "$OUT/specprefill_retrieval-gpu.json" ${SPEC_LC_EVAL_ARGS:-}
rc=$?
if [ "$heldout_s" -gt 30 ]; then
  # Retrieval alone with keys and values the task never trained on: does the copy carry over to any token.
  timeout -k 10 "$(( $(left) - 5 ))" $PY benchmarks/specprefill_retrieval.py --run "$RUN" --data "$DATA" --pairs heldout \
      --text-prompts 0 --variants "" --budget-s $(( $(left) - 20 )) --out "$OUT/specprefill_retrieval_heldout-gpu.json"
fi
echo "specprefill_lc: rc=$rc in $(( $(date +%s) - t_start )) s"
return $rc
}

main 2>&1 | tee "$OUT/specprefill_lc.log"
exit "${PIPESTATUS[0]}"
