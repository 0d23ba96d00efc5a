#!/usr/bin/env bash
# Training recipes for the long-context target side by side (issue 38): each variant trains the target alone
# (training/train_long_context.py train --target-only) for the same time, one after another (MLX's CUDA pools do not
# share a device: several trainings at once ran out of memory), and its log shows whether the answers' teacher-forced
# accuracy leaves chance (the copy forms) and when.
#
# Staging and running: benchmarks/README.md ("GPU runs").
# Writes under $OUT/lc_probe/: NAME.log (everything the variant printed), NAME.train_log.json, summary.json (per
# variant: steps, the answers' accuracy over its last logged steps, held-out retrieval).
# Environment: LC_PROBE_VARIANTS (variants, ";"-separated, each "NAME=extra train arguments"), LC_PROBE_BUDGET_S
# (each variant's training seconds, default 140), SPEC_LC_DATA, SITE (default /root/site), OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SITE=${SITE:-/root/site}
PY=${PY:-python3}
OUT=${OUT:-$REPO/benchmarks/results}
DATA=${SPEC_LC_DATA:-/tmp/specprefill_lc/data}
BUDGET_S=${LC_PROBE_BUDGET_S:-140}
# the table in docs/benchmarks.md ("What made the copy form")
VARIANTS=${LC_PROBE_VARIANTS:-"tied64=--curriculum 64x128@80:1 --tie;untied64=--curriculum 64x128@80:1;tied128lr=--curriculum 128x64@80:1 --tie --lr 1e-3"}
mkdir -p "$OUT/lc_probe" "$DATA"
. benchmarks/gpu_setup.sh || exit $?
if [ ! -e "$DATA/corpus.npz" ]; then
  TOKENIZERS_PARALLELISM=true $PY training/train_long_context.py prepare --out "$DATA" --train-tokens 8000000 \
      --heldout-tokens 1000000 || exit 4
fi
IFS=';' read -ra specs <<< "$VARIANTS"
for spec in "${specs[@]}"; do
  name=${spec%%=*}
  args=${spec#*=}
  # shellcheck disable=SC2086
  timeout -k 10 $((BUDGET_S + 120)) $PY training/train_long_context.py train --data "$DATA" --out "/tmp/lc_probe/$name" \
      --time-budget "$BUDGET_S" --target-only --no-compile --log-every 10 $args > "$OUT/lc_probe/$name.log" 2>&1
done
for spec in "${specs[@]}"; do
  name=${spec%%=*}
  cp "/tmp/lc_probe/$name/train_log.json" "$OUT/lc_probe/$name.train_log.json" 2>/dev/null
done
$PY - "$OUT/lc_probe" "$VARIANTS" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1]); out = {}
for spec in sys.argv[2].split(";"):
    name, _, args = spec.partition("=")
    f = d / f"{name}.train_log.json"
    if not f.exists():
        out[name] = {"args": args, "error": "no train_log.json (see the log)"}
        continue
    t = json.loads(f.read_text()); tail = t["log"][-5:]
    out[name] = {"args": args, "steps": t["steps"], "answer_acc_last": round(sum(r["target_answer_acc"] for r in tail) / len(tail), 3),
                 "ce_last": round(sum(r["target_ce"] for r in tail) / len(tail), 3), "heldout": t["eval"]["target"],
                 "first_acc_over_0.1_at_step": next((r["step"] for r in t["log"] if r["target_answer_acc"] > 0.1), None)}
(d / "summary.json").write_text(json.dumps(out, indent=2))
print(json.dumps(out, indent=2))
PY
