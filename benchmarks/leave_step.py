#!/usr/bin/env python3
"""Where the step a long prompt's row joins and leaves in spends its time.

In the stall benchmark (prefill_stall.py) on a GPU the longest gap of the running streams is the step in which a
16K-token prompt (max_tokens 1) finishes its prefill, joins the decode batch and leaves it: its decode part took
~3x a normal one. Here the engine as the server builds it (TextEngine with the prefix cache, calibrated chunks,
the warm-up on CUDA) runs --short rows while --rounds long prompts arrive one after another, and every call the
step makes in that phase is timed apart, the device synchronized around each: the prefill chunks, the join
(``batch.insert``), the decode step, the end-of-generation snapshot and the row's leaving (``batch.filter``).

  python benchmarks/leave_step.py --shape 2b --long 16384 --out leave_step-gpu.json     # a GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import provenance  # noqa: E402
from warmup_steps import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2b", choices=["trained", "2b", "small"])
    ap.add_argument("--short", type=int, default=300)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--long", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", default="1,2", help="of the long prompt, by round in turn (1: it joins and leaves in one step)")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    from vllm_mlx_mtp_routing.prefix_cache.cache import PrefixCache
    from vllm_mlx_mtp_routing.prefix_cache import plan as plan_module
    from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
    from vllm_mlx_mtp_routing.text_engine.engine import TextEngine
    from vllm_mlx_mtp_routing.text_engine.state import TextRequest
    from vllm_mlx_mtp_routing.text_engine.prefill_budget import DEFAULT_RATIO, calibrate

    model, _, tok, top_id, info = load(a.shape, "float32" if a.shape == "trained" else None)
    cache = None if a.no_prefix_cache else PrefixCache(model, 8 << 30, with_head=False)
    engine = TextEngine(model, tok, max_num_seqs=a.rows + 2, prefill_step_size=2048, prefix_cache=cache)
    sched = engine.scheduler
    sched.eos_ids = set()
    budget = calibrate(model, max_chunk=2048, ratio=DEFAULT_RATIO, vocab_size=top_id + 1)
    budget.apply(sched)
    if not a.no_warmup and mx.default_device() == mx.gpu:
        engine.warm_up()

    calls: list[tuple[str, float]] = []

    def settle() -> None:
        """Evaluate the batch caches' lazy arrays: a join's or a leave's copies are then its own, not the next step's."""
        arrays = [x for c in sched.cache.layers for x in [*vars(c).values(), *(getattr(c, "cache", None) or [])]]
        mx.eval([x for x in arrays if isinstance(x, mx.array)])

    def timed(name: str, fn, evaluate: bool = False):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            mx.synchronize()
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if evaluate:
                    settle()
                mx.synchronize()
                calls.append((name, time.perf_counter() - tic))
        return run

    sched._prefill_chunk = timed("prefill_chunk", sched._prefill_chunk)
    sched.batch.insert = timed("join_insert", sched.batch.insert, evaluate=True)
    sched.batch.filter = timed("leave_filter", sched.batch.filter, evaluate=True)
    sched.decode.step = timed("decode_step", sched.decode.step)
    plan_module.SnapshotPlan.after_generation = staticmethod(timed("end_snapshot", plan_module.SnapshotPlan.after_generation))

    rng = np.random.default_rng(0)
    for i in range(a.rows):
        sched.add(TextRequest(f"short-{i}", rng.integers(1, top_id, size=a.short).tolist(), SamplingOptions(max_tokens=1 << 30)))
    while len(sched.running) < a.rows:
        sched.step()
    for _ in range(8):
        sched.step()
    rounds = []
    for k in range(a.rounds):
        calls.clear()
        for _ in range(16):  # the streams' own steps, for their cadence
            sched.step()
        steady = [s for n, s in calls if n == "decode_step"]
        calls.clear()
        max_tokens = [int(n) for n in a.max_tokens.split(",")][k % len(a.max_tokens.split(","))]
        sched.add(TextRequest(f"long-{k}", rng.integers(1, top_id, size=a.long).tolist(), SamplingOptions(max_tokens=max_tokens)))
        steps = []
        while any(r.rid == f"long-{k}" for r in [*sched.waiting, *sched.prefilling, *sched.running]):
            calls.clear()
            tic = time.perf_counter()
            sched.step()
            mx.synchronize()
            wall = time.perf_counter() - tic
            steps.append({"step_s": round(wall, 4), **{n: round(s, 4) for n, s in calls if n != "prefill_chunk"},
                          "chunks": [round(s, 4) for n, s in calls if n == "prefill_chunk"]})
        last = steps[-4:]
        rounds.append({"round": k, "max_tokens": max_tokens, "decode_step_median_s": round(statistics.median(steady), 4), "steps": len(steps),
                       "last_steps": last, "longest_step_s": max(s["step_s"] for s in steps)})
        print(json.dumps(rounds[-1]), flush=True)
    out = {"benchmark": "leave_step", **provenance.record(), "model": info, "config": vars(a) | {"out": str(a.out)},
           "calibration": budget.stats(), "rounds": rounds}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
