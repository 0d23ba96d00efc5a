#!/usr/bin/env python3
"""Which decode steps of a growing batch are slow, and do they line up with the attention's key span?

Four rows of different lengths decode for --steps steps (plain [B, 1] steps, or MTP verifies of
[B, 2] keeping both tokens), growing by one or two positions a step. On MLX's CUDA backend the
attention reads ``RaggedKVCache.step``-rounded spans and multi-token queries run through cuDNN,
planned once per shape: a step whose span is new may pay a plan. Every step's time is recorded with
the batch's span and the garbage collector's time inside it (--gc: as is, the start-up heap frozen
as the server does, or off); the report lists steps over 3x the median, whether their span was new
and whether a collection ran in them.

  python benchmarks/step_spikes.py --shape 2b --out step_spikes-gpu.json      # a GPU
  python benchmarks/step_spikes.py --shape small --steps 64                  # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402

import kv_layout_ab as ab  # noqa: E402
import provenance  # noqa: E402
from vllm_mlx_mtp_routing.model.backbone import backbone_forward  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.batch_cache import BatchCache, RaggedKVCache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2b", choices=["trained", "2b", "small"])
    ap.add_argument("--lengths", default="300,420,510,700")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--gc", default="on", choices=["on", "freeze", "off"],
                    help="the garbage collector: as is, start-up heap frozen (as the server does), or disabled")
    ap.add_argument("--kinds", default="plain,verify")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dtype = "float32" if a.shape == "trained" else "bfloat16"
    model, make_prompts, info = ab.load_model(a.shape, dtype)
    lengths = [int(x) for x in a.lengths.split(",")]
    rows = []
    for n in lengths:
        c = model.make_cache()
        model(mx.array(make_prompts(1, n)[0], dtype=mx.uint32)[None], cache=c)
        mx.eval([x.state for x in c])
        rows.append(c)
    if a.gc == "freeze":
        gc.collect()
        gc.freeze()
    elif a.gc == "off":
        gc.disable()
    collected = [0.0]
    started = [0.0]
    gc.callbacks.append(lambda phase, info: started.__setitem__(0, time.perf_counter()) if phase == "start"
                        else collected.__setitem__(0, collected[0] + time.perf_counter() - started[0]))
    results = {}
    for kind, S in (("plain", 1), ("verify", 2)):
        if kind not in a.kinds.split(","):
            continue
        bc = BatchCache(model)
        for r in rows:
            bc.add_row(r)
        mx.eval(bc.state())
        attn = next(c for c in bc.layers if isinstance(c, RaggedKVCache))
        seen: set[int] = set()
        log = []
        for i in range(a.steps):
            span_before = attn._visible(attn.size() + S)
            new = span_before not in seen
            seen.add(span_before)
            t, gc_at = time.perf_counter(), collected[0]
            logits, _, captured = backbone_forward(model, mx.full((len(lengths), S), 5 + i % 50, dtype=mx.uint32),
                                                   bc.layers, capture=S > 1)
            mx.eval(logits, bc.state())
            log.append({"step": i, "s": round(time.perf_counter() - t, 5), "span": span_before, "new_span": new,
                        "gc_s": round(collected[0] - gc_at, 5)})
        med = statistics.median(x["s"] for x in log[1:])
        spikes = [x for x in log[1:] if x["s"] > 3 * med]
        results[kind] = {
            "median_s": round(med, 5), "spikes": spikes,
            "spikes_at_new_span": sum(x["new_span"] for x in spikes), "new_spans": sum(x["new_span"] for x in log[1:]),
            "median_s_at_new_span": round(statistics.median([x["s"] for x in log[1:] if x["new_span"]] or [0]), 5),
            "spikes_with_gc": sum(x["gc_s"] > 0.005 for x in spikes), "gc_s_total": round(sum(x["gc_s"] for x in log), 4),
        }
        print(kind, json.dumps(results[kind]), flush=True)
    out = {"benchmark": "step_spikes", **provenance.record(), "model": info,
           "config": {"lengths": lengths, "steps": a.steps, "step": RaggedKVCache.step, "gc": a.gc}, "results": results}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
