#!/usr/bin/env python3
"""Held-out perplexity of one or more checkpoints on the same windows (the SpecPrefill draft beside its target).

Each checkpoint is loaded with mlx_lm.load (the way the server loads a SpecPrefill draft; the VLM layout's
vision tower is dropped), cast to --dtype, and scored teacher-forced on the first --windows consecutive
windows of --seq tokens of the held-out standard-library files (train_tiny_qwen35.py's split rule), with
mlx-lm's own gated-delta recurrence.

  python training/eval_perplexity.py models/tiny-qwen35-draft models/tiny-qwen35-trained \
      --out benchmarks/results/draft_model.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_tiny_qwen35 import heldout_tokens


def perplexity(model, tokens, seq: int, windows: int, batch: int) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    n = min(windows, (tokens.size - 1) // (seq + 1))
    rows = np.stack([tokens[i * (seq + 1) : (i + 1) * (seq + 1)] for i in range(n)])
    ce_sum, tok_n = 0.0, 0
    for i in range(0, n, batch):
        x = mx.array(rows[i : i + batch])
        ce = nn.losses.cross_entropy(model(x[:, :-1]).astype(mx.float32), x[:, 1:], reduction="sum")
        ce_sum += ce.item()
        tok_n += x.shape[0] * seq
    return {"tokens": tok_n, "ce": round(ce_sum / tok_n, 4), "ppl": round(math.exp(ce_sum / tok_n), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--train-log", type=Path, help="the draft's train_log.json, copied into the report")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    tokens = heldout_tokens(a.models[0], a.stdlib)
    report = {"device": str(mx.default_device()), "mlx": mx.__version__, "python": platform.python_version(),
              "dtype": a.dtype, "windows": a.windows, "seq": a.seq, "models": {}}
    for path in a.models:
        model = load(str(path))[0]
        model.set_dtype(getattr(mx, a.dtype))
        tic = time.perf_counter()
        r = perplexity(model, tokens, a.seq, a.windows, a.batch)
        r["params"] = int(sum(v.size for _, v in tree_flatten(model.parameters())))
        r["dir_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        r["seconds"] = round(time.perf_counter() - tic, 1)
        report["models"][str(path)] = r
        print(json.dumps({str(path): r}), flush=True)
    if a.train_log:
        log = json.loads(a.train_log.read_text())
        report["train"] = {k: log[k] for k in ("device", "mlx", "params", "steps", "batch", "seq", "tokens_seen",
                                               "train_seconds", "ms_per_step", "eval", "args") if k in log}
        report["train"]["loss_log"] = [(r["step"], round(r["main_ce"], 4)) for r in log.get("log", [])]
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
