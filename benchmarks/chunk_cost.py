#!/usr/bin/env python3
"""A prefill chunk's time deep in a prompt: the calibration's projection against the clock.

The prefill calibration (vllm_mlx_mtp_routing/text_engine/prefill_budget.py) projects a chunk of n tokens
at prompt position p to take ``a + b * n + c * n * (p + n / 2)`` and shrinks chunks with the position so
none is projected past its chunk limit. Here the model calibrates, then a real prompt is prefilled (in
--prefill-step-size chunks) to each of --positions; at each, chunks of the calibrated size there
(``chunk_at(p)``), of 16 tokens and of the size at the prompt's start are timed (fastest of --repeats,
after one untimed run; the keys each run adds are trimmed off again) against their projections.

  python benchmarks/chunk_cost.py --shape trained --positions 0,2048,4096,8192 --out chunk_cost-cpu.json
  python benchmarks/chunk_cost.py --shape 2b --positions 0,4096,16384,32768 --out chunk_cost-gpu.json   # a GPU
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
from vllm_mlx_mtp_routing.model.mlx_lm_internals import KVCache  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.prefill_budget import MIN_CHUNK, calibrate, fastest_seconds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="trained", choices=["trained", "2b", "small"])
    ap.add_argument("--positions", default="0,2048,4096,8192")
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model, make_prompts, info = ab.load_model(a.shape, "float32" if a.shape == "trained" else "bfloat16")
    positions = sorted(int(p) for p in a.positions.split(","))
    budget = calibrate(model, max_chunk=a.prefill_step_size, ratio=a.ratio, vocab_size=1000)
    prompt = mx.array(make_prompts(1, positions[-1] + 2 * a.prefill_step_size)[0], dtype=mx.uint32)[None]
    cache = model.make_cache()
    layers = [c for c in cache if isinstance(c, KVCache)]
    done, rows = 0, []
    for p in positions:
        while done < p:
            n = min(a.prefill_step_size, p - done)
            mx.eval(model(prompt[:, done : done + n], cache=cache))
            done += n
        for n in sorted({budget.chunk_at(p), MIN_CHUNK, budget.chunk_tokens}):
            tokens = prompt[:, p : p + n]

            def chunk() -> None:
                mx.eval(model(tokens, cache=cache))
                for c in layers:
                    c.trim(n)

            chunk()
            measured = fastest_seconds(chunk, a.repeats)
            rows.append({"position": p, "tokens": n, "calibrated_here": n == budget.chunk_at(p),
                         "measured_s": round(measured, 5), "projected_s": round(budget.chunk_s(n, p), 5),
                         "measured_over_limit": round(measured / budget.chunk_limit_s, 3)})
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "chunk_cost", **provenance.record(), "model": info, "budget": budget.stats(),
              "config": vars(a) | {"out": str(a.out)}, "results": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"budget": {k: budget.stats()[k] for k in ("chunk_tokens", "attention_s", "probe_depth",
                                                                  "chunk_limit_s", "chunk_at")}}))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
