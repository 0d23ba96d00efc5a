#!/usr/bin/env bash
# Chat fine-tune of models/tiny-qwen35-trained (issue 35: the committed model should end its replies), in one call:
# training/chat_tune_tiny_qwen35.py train from the committed weights (time-budgeted; its data are built here from the
# committed tokenizer and this machine's standard library, fixed seed), assemble into a checkpoint declaring Qwen3.5's
# 262144-position context, then training/eval_chat_tiny_qwen35.py on the tuned checkpoint (greedy replies that end
# with <|im_end|> within 256 tokens: held-out short conversations, the agents' recorded requests, 10K and 30K-token
# agent-like prompts; MTP acceptance on held-out code) and the same on the committed checkpoint, for the ratio.
#
# Staging and running: benchmarks/README.md ("GPU runs"); nothing to carry beyond the checkout.
# Writes under $OUT: chat_tune.log (everything printed), train_log.json, chat-00..02.safetensors (the tuned weights,
# fp32, ~40 MB; assembly casts them to the checkpoint's bf16), eval_chat.json (tuned), eval_chat_base.json (committed model).
# Assemble them on the workstation (docs/development.md, "The chat fine-tune"):
#   python training/chat_tune_tiny_qwen35.py assemble --base models/tiny-qwen35-trained --weights $OUT \
#       --out models/tiny-qwen35-trained
# Environment: CHAT_TUNE_BUDGET_S (wall seconds for everything, setup included, default 450), CHAT_TUNE_EVAL_S
# (seconds kept for the two evaluations, default 150), CHAT_TUNE_ARGS (extra train arguments, e.g. "--steps 600" to
# repeat a logged run), CHAT_EVAL_ARGS (extra eval arguments), SITE (default /root/site), OUT (default
# benchmarks/results/chat_tune).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results/chat_tune}
BUDGET_S=${CHAT_TUNE_BUDGET_S:-450}
EVAL_S=${CHAT_TUNE_EVAL_S:-150}
RUN=/tmp/chat_tune
mkdir -p "$OUT" "$RUN"

main() {
t_start=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - t_start))); }
. benchmarks/gpu_setup.sh || exit $?
train_s=$(( $(left) - EVAL_S - 20 ))
echo "chat_tune: setup done, training for $train_s s"
[ "$train_s" -gt 30 ] || { echo "chat_tune: no time left to train"; exit 5; }
# the training stops itself at its budget (setup and its first steps' kernel JIT included); the timeout only guards
# shellcheck disable=SC2086
timeout -k 10 $(( train_s + 60 )) $PY training/chat_tune_tiny_qwen35.py train --base models/tiny-qwen35-trained \
    --out "$RUN/weights" --time-budget "$train_s" --batch 32 --chat-batch 8 --chat-seq 2048 --long-seq 8192 --end-weight 2 \
    ${CHAT_TUNE_ARGS:-} | grep -v '^\[transformers\]' || exit 6
cp "$RUN/weights/train_log.json" "$RUN"/weights/chat-*.safetensors "$OUT/"
$PY training/chat_tune_tiny_qwen35.py assemble --base models/tiny-qwen35-trained --weights "$RUN/weights" \
    --out "$RUN/model" || exit 7
eval_s=$(( $(left) - 10 ))
echo "chat_tune: tuned model assembled, $eval_s s for the evaluations"
# shellcheck disable=SC2086
timeout -k 10 $(( eval_s * 6 / 10 )) $PY training/eval_chat_tiny_qwen35.py "$RUN/model" --out "$OUT/eval_chat.json" \
    ${CHAT_EVAL_ARGS:-} | grep -v '^\[transformers\]'
rc=${PIPESTATUS[0]}
eval_s=$(( $(left) - 5 ))
if [ "$eval_s" -gt 20 ]; then
  # the committed model: short prompts and MTP acceptance only (its replies run to the limit, so no long ones)
  timeout -k 5 "$eval_s" $PY training/eval_chat_tiny_qwen35.py models/tiny-qwen35-trained --short 10 \
      --long-tokens "" --out "$OUT/eval_chat_base.json" | grep -v '^\[transformers\]'
fi
echo "chat_tune: rc=$rc in $(( $(date +%s) - t_start )) s"
return $rc
}

main 2>&1 | tee "$OUT/chat_tune.log"
exit "${PIPESTATUS[0]}"
