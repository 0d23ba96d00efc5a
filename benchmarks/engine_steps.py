#!/usr/bin/env python3
"""Paired A/B of the text engine's step costs between two checkouts, on the committed trained model.

Each round runs one child process per checkout (the order alternating between rounds); each child imports the package
from its own checkout and measures, through the scheduler's public API (``add``, ``step``):

- decode: the median seconds of a steady decode step with B rows (every row prefilled and joined, none finishing),
  plain and with MTP (k = 1, drafting every step), at each batch size;
- prefill: the seconds until a lone prompt of ``--prefill-tokens`` tokens is prefilled and joined.

A ratio is the median over rounds of (--new) / (--base) in the same round, so a slow phase of a shared machine weighs
on both. CPU seconds of the whole child are reported too.

  python benchmarks/engine_steps.py --base ../checkout-before --rounds 5 --out results/engine_steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
for m in [m for m in sys.modules if m.startswith("vllm_mlx_mtp_routing")]:
    del sys.modules[m]  # the installed start-up hook imported it: import it from the checkout given
sys.path.insert(0, sys.argv[1])
import vllm_mlx_mtp_routing
assert vllm_mlx_mtp_routing.__file__.startswith(sys.argv[1]), vllm_mlx_mtp_routing.__file__
import mlx.core as mx
from mlx_vlm import load
try:
    from vllm_mlx_mtp_routing.model.text_model import build_text_model
except ImportError:
    from vllm_mlx_mtp_routing.text_model import build_text_model
try:
    from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
    from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
    from vllm_mlx_mtp_routing.text_engine.state import TextRequest
    from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
except ImportError:  # a checkout from before the scheduler/runner split
    from vllm_mlx_mtp_routing.text_engine import BatchScheduler, MTPDecode, SamplingOptions, TextRequest
from pathlib import Path

path = Path(sys.argv[2]); batches = [int(b) for b in sys.argv[3].split(",")]; steps = int(sys.argv[4])
prefill_tokens = int(sys.argv[5])
vlm, processor = load(str(path))
bundle = build_text_model(vlm, path, json.loads((path / "config.json").read_text()))
tok = processor.tokenizer
vocab = bundle.model.args.vocab_size

def prompt(i, n):
    return [(i * 7919 + j * 104729) % (vocab - 10) + 10 for j in range(n)]

def decode_step_s(B, mtp):
    decode = MTPDecode(bundle.mtp, k=1, adaptive=False) if mtp else None
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=B, prefill_step_size=2048, eos_token_ids=[], decode=decode)
    sched.eos_ids = set()
    for i in range(B):
        sched.add(TextRequest(str(i), prompt(i, 24), SamplingOptions(max_tokens=1 << 20)))
    while len(sched.running) < B:
        sched.step()
    for _ in range(3):
        sched.step()
    times = []
    for _ in range(steps):
        tic = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - tic)
    mx.synchronize()
    return statistics.median(times)

def prefill_s(n):
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=1, prefill_step_size=2048, eos_token_ids=[])
    sched.add(TextRequest("w", prompt(1, 64), SamplingOptions(max_tokens=1)))
    while sched.has_work():
        sched.step()
    # max_tokens 2: the row stays in the batch after the step it joins in (at 1 it would leave in that step)
    sched.add(TextRequest("p", prompt(2, n), SamplingOptions(max_tokens=2)))
    tic = time.perf_counter()
    while not sched.running:
        sched.step()
    mx.synchronize()
    return time.perf_counter() - tic

import statistics
out = {}
for B in batches:
    out[f"decode_b{B}"] = decode_step_s(B, False)
    out[f"mtp_b{B}"] = decode_step_s(B, True)
out["prefill"] = prefill_s(prefill_tokens)
u = resource.getrusage(resource.RUSAGE_SELF)
out["cpu_s"] = u.ru_utime + u.ru_stime
print("RESULT " + json.dumps(out))
"""


def child(checkout: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(checkout.resolve()), str(args.model), args.batches, str(args.steps),
         str(args.prefill_tokens)],
        capture_output=True, text=True, env=env, check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"child for {checkout} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the checkout to compare against")
    p.add_argument("--new", type=Path, default=ROOT, help="the checkout measured (default: this one)")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-qwen35-trained")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per configuration")
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        order = [("base", args.base), ("new", args.new)] if r % 2 == 0 else [("new", args.new), ("base", args.base)]
        result = {name: child(path, args) for name, path in order}
        rounds.append(result)
        print(f"round {r + 1}: " + ", ".join(f"{k} {result['new'][k] / result['base'][k]:.3f}" for k in result["new"]),
              flush=True)
    keys = list(rounds[0]["new"])
    ratios = {k: statistics.median(rd["new"][k] / rd["base"][k] for rd in rounds) for k in keys}
    summary = {"ratios_new_over_base": ratios, "rounds": rounds, "args": {k: str(v) for k, v in vars(args).items()}}
    print(json.dumps({"ratios_new_over_base": {k: round(v, 4) for k, v in ratios.items()}}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
