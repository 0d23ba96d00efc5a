#!/usr/bin/env python3
"""Draft policies side by side in lockstep: decode throughput of each against plain decoding.

For each batch size B, every configuration decodes the same B prompts (greedy) in its own
scheduler, and the schedulers step in turn, one step each (the order rotating every cycle), so a
slow phase of a shared machine (seconds long: another process's test run) falls on every
configuration alike instead of on whichever ran then; mtp_decode_bench runs them one after another
and on the 2-core machine shared with other sessions its per-round ratios swung 0.5-2.3x. A
configuration's tok/s counts its decode steps only (``mtp_decode_bench.DecodeTimer``), with the device
work a step leaves running (MTP's rollback overlaps the scheduler's bookkeeping) awaited before the next
configuration steps and counted to its own. Each policy times its steps from the end of its own previous
step; the time the other configurations took in between is taken out (``LockstepPolicy``: as if it had
run alone), so what it learns is its own cost.

  plain, plain_control  plain decoding, ``decode=None`` (the second is the noise floor: control / plain)
  always                MTPDecode, every row drafting k every step (--mtp-schedule always)
  cost                  MTPDecode with the cost-model DraftPolicy (kept across rounds, as a server
                        keeps it); cost_cold: a fresh one every round (its learning in the timing);
                        both as ``LockstepPolicy``

The exploring schedule the cost model replaced (``DraftSchedule``: throughput arms per draft count,
explorations with back-off, ~12 tunables) ran beside them as ``explore`` / ``explore_cold`` in the
run that decided it (benchmarks/results/policy_ab_cpu.json, which records its commit) and was removed after.

Speedups are per round against the mean of that round's two plain runs; the median over rounds is
reported. The first round is a warm-up (shapes compiled, kept policies trained).

  python benchmarks/policy_ab.py --out benchmarks/results/policy_ab_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402

import mtp_decode_bench as mb  # noqa: E402
import provenance  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.spec.draft_policy import DraftPolicy  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.state import TextRequest  # noqa: E402


class LockstepPolicy(DraftPolicy):
    """The draft policy, told each step's cost without the other configurations' steps in between: ``MTPDecode``
    times a step from the end of its previous one, and ``lockstep`` adds to ``others`` the time from this
    configuration's last step (its device work awaited) to its next one, which is taken off."""

    def __init__(self, k: int, **options) -> None:
        super().__init__(k, **options)
        self.others = 0.0

    def observe(self, rows, k, drafting, accepted, *, seconds, shape, timed=True) -> None:
        if seconds is not None:
            seconds -= self.others
        self.others = 0.0
        super().observe(rows, k, drafting, accepted, seconds=seconds, shape=shape, timed=timed)


def lockstep(bundle, tok, prompts, max_tokens, decodes: dict, order_seed: int) -> dict:
    """Run every configuration's scheduler one step at a time, in turn. -> name: (DecodeTimer, tokens)."""
    runs = {}
    with contextlib.ExitStack() as timers:
        for name, decode in decodes.items():
            sched = BatchScheduler(bundle.model, tok, max_num_seqs=len(prompts), prefill_step_size=4096,
                                   eos_token_ids=[], decode=decode)
            for i, p in enumerate(prompts):
                sched.add(TextRequest(str(i), p, SamplingOptions(max_tokens=max_tokens)))
            policy = decode.policy if decode is not None and isinstance(decode.policy, LockstepPolicy) else None
            runs[name] = {"sched": sched, "timer": timers.enter_context(mb.DecodeTimer(sched)), "policy": policy,
                          "finals": {}, "paused": None}
        names = list(runs)
        cycle = order_seed
        while any(r["sched"].has_work() for r in runs.values()):
            cycle += 1
            for name in names[cycle % len(names):] + names[: cycle % len(names)]:
                r = runs[name]
                if not r["sched"].has_work():
                    continue
                if r["policy"] is not None and r["paused"] is not None:
                    # Its cycle as if alone: its own work after its last step, not the others' steps.
                    r["policy"].others += time.perf_counter() - r["paused"]
                for o in r["sched"].step():
                    if o.finished:
                        r["finals"][int(o.request_id)] = o.token_ids
                # MTP leaves its rollback running (async) while the scheduler does its bookkeeping:
                # it must end here, counted to this configuration, not inside the next one's step.
                t = time.perf_counter()
                mx.synchronize()
                r["paused"] = time.perf_counter()
                if r["timer"].end is not None:
                    r["timer"].seconds += r["paused"] - t
    return {n: (r["timer"], [r["finals"][i] for i in range(len(prompts))]) for n, r in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds after the warm-up round")
    ap.add_argument("--configs", default="always,cost,cost_cold")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    path, bundle, tok, source = mb.load_bundle(None)
    if "FORCED" in source:
        raise SystemExit("needs models/tiny-qwen35-trained (real acceptance)")
    batches = [int(b) for b in a.batches.split(",")]
    prompts_all = mb.make_prompts(tok, max(batches), a.prompt_tokens)
    k = a.k
    factories = {
        "always": (lambda: MTPDecode(bundle.mtp, k=k, adaptive=False), False),
        "cost": (lambda: MTPDecode(bundle.mtp, k=k, policy=LockstepPolicy(k, adaptive=True)), True),
        "cost_cold": (lambda: MTPDecode(bundle.mtp, k=k, policy=LockstepPolicy(k, adaptive=True)), False),
    }
    chosen = [c for c in a.configs.split(",") if c in factories]
    result = {"benchmark": "policy_ab", "model": str(path.name), "acceptance_source": source, "k": k,
              "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens, "rounds": a.rounds,
              **provenance.record(), "rows": []}
    for B in batches:
        prompts = prompts_all[:B]
        kept: dict = {}
        per: dict[str, list[float]] = {n: [] for n in ["plain", "plain_control", *chosen]}
        counts = {n: [0, 0] for n in chosen}
        exact = {n: True for n in chosen}
        for rnd in range(a.rounds + 1):
            decodes = {"plain": None, "plain_control": None}
            for n in chosen:
                make, keep = factories[n]
                decodes[n] = kept.get(n) or make()
                if keep:
                    kept[n] = decodes[n]
            before = {n: (decodes[n].steps_with_mtp, decodes[n].steps_without_mtp) for n in chosen}
            runs = lockstep(bundle, tok, prompts, a.max_tokens, decodes, order_seed=rnd)
            ref = runs["plain"][1]
            if not rnd:
                continue
            for n, (timed, tokens) in runs.items():
                per[n].append(timed.tokens / timed.seconds)
                if n in chosen:
                    exact[n] &= tokens == ref
                    counts[n][0] += decodes[n].steps_with_mtp - before[n][0]
                    counts[n][1] += decodes[n].steps_without_mtp - before[n][1]
        plain = [(p + c) / 2 for p, c in zip(per["plain"], per["plain_control"])]
        row = {"batch": B, "plain_tok_s": round(statistics.median(plain), 1),
               "plain_control_ratio": round(statistics.median(c / p for p, c in zip(per["plain"], per["plain_control"])), 3),
               "plain_control_per_round": [round(c / p, 3) for p, c in zip(per["plain"], per["plain_control"])]}
        for n in chosen:
            ratios = [t / p for t, p in zip(per[n], plain)]
            row[n] = {"tok_s": round(statistics.median(per[n]), 1), "speedup": round(statistics.median(ratios), 3),
                      "speedup_per_round": [round(x, 3) for x in ratios], "steps_with_mtp": counts[n][0],
                      "steps_without_mtp": counts[n][1], "exact": exact[n]}
            if n in kept:
                row[n]["policy"] = kept[n].policy.stats()
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
    mx.clear_cache()


if __name__ == "__main__":
    main()
