"""A/B of the verify step's gated-delta capture in one process: t2 (2-token verify with state
capture and per-row rollback) with an older ``mtp_decode`` module's capture against the current
one, alternating, at batch 1 / 2 / 4 / 8 (t1 and mlx-lm's own uncaptured forward for reference).

  git show 990d23c:vllm_mlx_mtp_routing/text_engine/mtp_decode.py \\
      | sed 's/^from \\.\\./from vllm_mlx_mtp_routing./; s/^from \\./from vllm_mlx_mtp_routing.text_engine./' \\
      > /tmp/old_mtp_decode.py
  python benchmarks/capture_ab.py --old /tmp/old_mtp_decode.py --out capture_ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import mtp_decode_bench as mb
from types import SimpleNamespace

from vllm_mlx_mtp_routing.model import backbone as new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="an older mtp_decode.py (absolute imports)")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("old_mtp_decode", a.old)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # its dataclasses look their module up
    spec.loader.exec_module(old)
    # an old module's rollback took the BatchCache, the current one its layers
    old_rollback = (lambda layers, *rest: old.rollback_rows(SimpleNamespace(layers=layers), *rest)) \
        if "cache: BatchCache" in a.old.read_text() else old.rollback_rows
    variants = {"old": (old._gated_delta_capture, old_rollback), "new": (new._gated_delta_capture, new.rollback_rows)}
    _, bundle, tok, _ = mb.load_bundle(None)
    out = {"device": str(mb.mx.default_device()), "gpu": mb.gpu_name(), "old": str(a.old), "rows": []}
    for B in (int(b) for b in a.batches.split(",")):
        prompts = mb.make_prompts(tok, B, 64)
        runs: dict[str, list[float]] = {"old": [], "new": [], "t1": [], "nocap": []}
        for rep in range(a.reps):
            for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                new._gated_delta_capture, mb.rollback_rows = variants[name]  # backbone_forward looks it up
                costs = mb.step_costs(bundle, prompts, 1, a.iters, tok)
                runs[name].append(costs["t2_ms"])
                runs["t1"].append(costs["t1_ms"])
                runs["nocap"].append(costs["t2_nocapture_ms"])
        row = {"batch": B, **{f"{k}_ms": round(statistics.median(v), 3) for k, v in runs.items()}}
        row["t2_over_t1_old"] = round(row["old_ms"] / row["t1_ms"], 3)
        row["t2_over_t1_new"] = round(row["new_ms"] / row["t1_ms"], 3)
        print(json.dumps(row), flush=True)
        out["rows"].append({**row, "runs": runs})
    new._gated_delta_capture, mb.rollback_rows = variants["new"]
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
