#!/usr/bin/env python3
"""What the first decode steps of new batch shapes cost (one-off compiles and plans) on this device.

For batch sizes 1..--max-batch, a batch of --short-token rows takes a plain step and an MTP-style
verify ([B, 2], gated-delta capture) twice: the first time of a shape against the second. Then the
same for a batch with one --long-token row (the long prompt's join). On MLX's CUDA backend kernels
of ours (mx.fast.cuda_kernel) and some of MLX's are compiled at their first use per template, and
cuDNN plans attention per shape; a server meets each at its first request of that shape.

  python benchmarks/first_steps.py --shape 2b --out first_steps-gpu.json      # a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402

import kv_layout_ab as ab  # noqa: E402
import provenance  # noqa: E402
from join_step import prefilled  # noqa: E402
from vllm_mlx_mtp_routing.model.backbone import backbone_forward  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.batch_cache import BatchCache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2b", choices=["trained", "2b", "small"])
    ap.add_argument("--max-batch", type=int, default=6)
    ap.add_argument("--short", type=int, default=300)
    ap.add_argument("--long", type=int, default=16384)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model, make_prompts, info = ab.load_model(a.shape, "float32" if a.shape == "trained" else "bfloat16")
    rows = [prefilled(model, p, 2048) for p in make_prompts(a.max_batch, a.short)]
    long_row = prefilled(model, make_prompts(1, a.long)[0], 2048)

    def timed(bc: BatchCache, S: int) -> float:
        t = time.perf_counter()
        logits, _, captured = backbone_forward(model, mx.full((bc.batch_size, S), 9, dtype=mx.uint32), bc.layers, capture=S > 1)
        mx.eval(logits, bc.state())
        if S > 1:
            bc.rollback(captured, [1] * bc.batch_size, S)
            mx.eval(bc.state())
        return round(time.perf_counter() - t, 4)

    results = []
    for with_long in (False, True):
        for B in range(1, a.max_batch + 1):
            bc = BatchCache(model)
            for r in rows[: B - 1 if with_long else B]:
                bc.add_row(r)
            if with_long:
                bc.add_row(long_row)
            mx.eval(bc.state())
            entry = {"batch": B, "long_row": with_long}
            for kind, S in (("plain", 1), ("verify", 2)):
                entry[kind] = [timed(bc, S), timed(bc, S)]
            results.append(entry)
            print(json.dumps(entry), flush=True)
    out = {"benchmark": "first_steps", **provenance.record(), "model": info,
           "config": {"short": a.short, "long": a.long, "max_batch": a.max_batch}, "results": results}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
