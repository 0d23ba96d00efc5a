#!/usr/bin/env python3
"""The decode step a long prompt's row joins: attention in one call vs split by row length.

Four short rows decode; a long prompt's row joins them (the stall of BENCHMARKS.md section 7: in one
attention call every row reads the long row's span). Timed in one process, blocks of steps
alternating between the batches so a slow phase of a shared machine weighs on all:

- ``short``: the short rows alone (the streams' usual step);
- ``long``: the long row alone;
- ``joined_single``: all rows, one attention call (``RaggedKVCache.group_overhead = 0``: the engine
  before the split);
- ``joined_grouped``: all rows, the attention split as the engine plans it (the device's default
  ``group_overhead``, or --overhead).

Steps: ``plain`` ([B, 1]) and ``verify`` ([B, 2] with the gated-delta capture and a rollback of the
draft, MTP's verify without the head). The first step of each batch is reported apart (one-off
compiles and, on CUDA, attention plans for new shapes). Logits of the single and split calls are
compared at every step (bitwise on the CPU).

  python benchmarks/join_step.py --out join_step-cpu.json                      # trained tiny model, 8K row
  python benchmarks/join_step.py --shape 2b --long 16384 --out join_step-gpu.json   # a GPU
"""

from __future__ import annotations

import argparse
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
from vllm_mlx_mtp_routing.text_engine.batch_cache import BatchCache, RaggedKVCache, default_group_overhead  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels.swaps import use_grouped_attention  # noqa: E402


def prefilled(model, prompt: list[int], chunk: int):
    c = model.make_cache()
    for i in range(0, len(prompt), chunk):
        model(mx.array(prompt[i : i + chunk], dtype=mx.uint32)[None], cache=c)
        mx.eval([x.state for x in c])
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="trained", choices=["trained", "2b", "small"])
    ap.add_argument("--dtype", default=None, help="default: float32 for the trained model, bfloat16 otherwise")
    ap.add_argument("--short", type=int, default=300, help="tokens per short row")
    ap.add_argument("--rows", type=int, default=4, help="short rows")
    ap.add_argument("--long", type=int, default=8192, help="tokens of the joining row")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per batch and kind")
    ap.add_argument("--block", type=int, default=4, help="steps per batch before switching")
    ap.add_argument("--overhead", type=int, default=None, help="group_overhead of the split batch (default: the device's)")
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    dtype = a.dtype or ("float32" if a.shape == "trained" else "bfloat16")
    model, make_prompts, info = ab.load_model(a.shape, dtype)
    use_grouped_attention(model)  # the engine's model has it (text_model.build_text_model); a built shape not yet
    overhead = default_group_overhead() if a.overhead is None else a.overhead
    t0 = time.perf_counter()
    short = [prefilled(model, p, a.prefill_chunk) for p in make_prompts(a.rows, a.short)]
    long_row = prefilled(model, make_prompts(1, a.long)[0], a.prefill_chunk)
    prefill_s = time.perf_counter() - t0

    def batch(rows) -> BatchCache:
        bc = BatchCache(model)
        for r in rows:
            bc.add_row(r)
        mx.eval(bc.state())
        return bc

    setups = {  # name -> (cache, group_overhead)
        "short": (batch(short), overhead),
        "long": (batch([long_row]), overhead),
        "joined_single": (batch(short + [long_row]), 0),
        "joined_grouped": (batch(short + [long_row]), overhead),
    }

    def run(kind: str, name: str, token: int) -> tuple[float, mx.array]:
        bc, ov = setups[name]
        RaggedKVCache.group_overhead = ov
        B = bc.batch_size
        S = 1 if kind == "plain" else 2
        inputs = mx.full((B, S), token, dtype=mx.uint32)
        t = time.perf_counter()
        logits, _, captured = backbone_forward(model, inputs, bc.layers, capture=S > 1)
        mx.eval(logits, bc.state())
        if S > 1:  # keep the token, drop the draft, as a rejected draft does
            bc.rollback(captured, [1] * B, S)
            mx.eval(bc.state())
        return time.perf_counter() - t, logits

    results: dict = {}
    for kind in ("plain", "verify"):
        times: dict[str, list[float]] = {n: [] for n in setups}
        first: dict[str, float] = {}
        max_diff = 0.0
        for n in setups:  # first steps apart
            first[n] = round(run(kind, n, 7)[0], 5)
        for blk in range(-(-a.steps // a.block)):
            ref: list[mx.array] = []
            for n in setups:
                for j in range(a.block):
                    dt, logits = run(kind, n, 11 + blk * a.block + j)
                    times[n].append(dt)
                    if n == "joined_single":
                        ref.append(logits)
                    elif n == "joined_grouped":  # the same tokens as the single call's j-th step
                        diff = mx.abs(logits.astype(mx.float32) - ref[j].astype(mx.float32)).max().item()
                        max_diff = max(max_diff, diff)
        med = {n: statistics.median(t) for n, t in times.items()}
        results[kind] = {
            "median_s": {n: round(v, 5) for n, v in med.items()},
            "first_step_s": first,
            "joined_single_vs_short": round(med["joined_single"] / med["short"], 3),
            "joined_grouped_vs_short": round(med["joined_grouped"] / med["short"], 3),
            "grouped_vs_single": round(med["joined_grouped"] / med["joined_single"], 3),
            "logits_max_abs_diff_grouped_vs_single": max_diff,
        }
        print(kind, json.dumps(results[kind]), flush=True)

    out = {
        "benchmark": "join_step", **provenance.record(), "model": info,
        "config": {"short_rows": a.rows, "short_tokens": a.short, "long_tokens": a.long, "steps": a.steps,
                   "block": a.block, "group_overhead": overhead, "dtype": dtype, "prefill_s": round(prefill_s, 1)},
        "results": results,
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
