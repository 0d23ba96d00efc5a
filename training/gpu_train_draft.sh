#!/usr/bin/env bash
# Train the SpecPrefill draft (train_tiny_qwen35.py --shape draft) on MLX's CUDA backend, with the trained model's
# recipe (batch 64 x 256 tokens, AdamW 2e-3, cosine; no MTP head). The CPU run committed as models/tiny-qwen35-draft
# saw only 66 steps in 29 min on 2 shared cores; this is the same script at the trained model's scale.
#
# On the workstation (Python 3.11.7's stdlib is the corpus; the GPU machine's Python differs):
#   python training/train_tiny_qwen35.py prepare --out /tmp/tq35d --shape draft --tokenizer-from models/tiny-qwen35-trained
#   mkdir -p .device-b/draft-data && cp /tmp/tq35d/{corpus.npz,text_config.json,shape.json} .device-b/draft-data/
# then one device call (MLX staged as gpu_serve.sh describes):
#   call, carry [.device-b]:  bash training/gpu_train_draft.sh
# and back on the workstation, with the returned $OUT/draft-run:
#   python training/train_tiny_qwen35.py assemble --data /tmp/tq35d --weights <returned>/draft-run \
#       --out models/tiny-qwen35-draft
# Environment: DRAFT_STEPS (default 1113, the trained model's count), DRAFT_BATCH (64), SITE, OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/training/results}
mkdir -p "$OUT/draft-run"
{
. benchmarks/gpu_setup.sh || exit $?
$PY training/train_tiny_qwen35.py train --data "${DRAFT_DATA:-.device-b/draft-data}" --out "$OUT/draft-run" \
    --steps "${DRAFT_STEPS:-1113}" --batch "${DRAFT_BATCH:-64}" --seq 256
} 2>&1 | tee "$OUT/draft-train.log"
exit "${PIPESTATUS[0]}"
