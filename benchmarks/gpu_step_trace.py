#!/usr/bin/env python3
"""Per-step decode times of plain and per-row MTP runs back to back (diagnosis of slow runs on
MLX-CUDA): for each run, the median / p90 / max step time and how many steps took > 3x the median.

  python benchmarks/gpu_step_trace.py --batch 4 --runs 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mtp_decode_bench as mb  # noqa: E402

from vllm_mlx_mtp_routing.text_engine.decode import SingleTokenDecode  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode  # noqa: E402


class Steps:
    def __init__(self, inner):
        self.inner, self.times, self.shapes, self.tokens, self.seconds = inner, [], [], 0, 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, model, cache, inputs, samplers):
        t = time.perf_counter()
        r = self.inner.step(model, cache, inputs, samplers)
        self.times.append(1000 * (time.perf_counter() - t))
        self.shapes.append((len(inputs), max(r.drafted, default=0), max(cache.lengths())))
        self.tokens += sum(len(x) for x in r.tokens)
        return r


def staggered(bundle, tok, prompts, max_num_seqs, max_tokens, decode):
    """Requests arrive one every 8 steps at most max_num_seqs run at once; decode.seconds/tokens."""
    t0 = time.perf_counter()
    sched = mb.BatchScheduler(bundle.model, tok, max_num_seqs=max_num_seqs, prefill_step_size=4096,
                              eos_token_ids=[], decode=decode)
    pending, step = list(enumerate(prompts)), 0
    while pending or sched.has_work():
        if pending and step % 8 == 0:
            i, p = pending.pop(0)
            sched.add(mb.TextRequest(str(i), p, mb.SamplingOptions(max_tokens=max_tokens)))
        sched.step()
        step += 1
    decode.seconds = time.perf_counter() - t0
    return decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--order", default="plain,mtp,mtp,plain,adaptive,mtp")
    ap.add_argument("--staggered", action="store_true",
                    help="serving-like: 2*batch prompts of 20-200 tokens, one arriving every 8 steps")
    a = ap.parse_args()
    path, bundle, tok, _ = mb.load_bundle(None)
    prompts = mb.make_prompts(tok, a.batch, 64)
    makers = {
        "plain": SingleTokenDecode,
        "mtp": lambda: MTPDecode(bundle.mtp, k=1, adaptive=False),
        "adaptive": lambda: MTPDecode(bundle.mtp, k=1),
    }
    if a.staggered:
        pool = mb.make_prompts(tok, 2 * a.batch, 200)
        prompts = [p[: 20 + (37 * i) % 181] for i, p in enumerate(pool)]
    for name in a.order.split(","):
        d = Steps(makers[name]())
        t = time.perf_counter()
        if a.staggered:
            timed = staggered(bundle, tok, prompts, a.batch, a.max_tokens, d)
        else:
            _, timed = mb.run(bundle, tok, prompts, a.max_tokens, d)
        wall = time.perf_counter() - t
        ts = sorted(d.times)
        med = statistics.median(ts)
        slow = [(i, round(x, 1), d.shapes[i]) for i, x in enumerate(d.times) if x > 3 * med][:12]
        print(f"{name:9s} tok/s {timed.tokens / timed.seconds:7.1f} wall {wall:5.2f}s steps {len(ts)} "
              f"median {med:.2f} p90 {ts[int(0.9 * len(ts))]:.2f} max {ts[-1]:.1f} ms; "
              f">3x median: {sum(x > 3 * med for x in ts)}; first 12: {[round(x, 1) for x in d.times[:12]]}; "
              f"slow (step, ms, (B, drafting, KV slots)): {slow}", flush=True)
        by: dict[tuple[int, int], list[float]] = {}
        for x, (B, k, _) in zip(d.times, d.shapes):
            by.setdefault((B, k), []).append(x)
        print("   median ms by (B, drafts):", {f"{B},{k}": (len(v), round(statistics.median(v), 2))
                                                for (B, k), v in sorted(by.items())}, flush=True)


if __name__ == "__main__":
    main()
