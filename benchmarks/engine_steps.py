#!/usr/bin/env python3
"""A/B of the text engine's step costs between two checkouts, in one process, on the committed trained model.

Both checkouts' packages are imported side by side (under two names), each on its own copy of the model, and their
work alternates in short blocks, so a slow phase of a shared machine weighs on both alike (separate processes per
checkout differed by up to 25% between runs of the same code here). Through the scheduler's public API (``add``,
``step``) it measures:

- decode: wall and CPU seconds of steady decode steps with B rows (every row prefilled and joined, none finishing),
  plain and with MTP (k = 1, drafting every step), at each batch size, in alternating blocks of ``--block`` steps;
- prefill: the seconds until a lone prompt of ``--prefill-tokens`` tokens is prefilled and joined, alternating.

Ratios are --new over --base (the sums over all blocks; the prefill's medians).

  python benchmarks/engine_steps.py --base ../checkout-before --out results/engine_steps.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Side:
    """One checkout's engine API, on its own copy of the model."""

    name: str
    bundle: Any
    tokenizer: Any
    scheduler: Any  # BatchScheduler
    mtp: Any  # MTPDecode
    request: Any  # TextRequest
    options: Any  # SamplingOptions


def load_side(name: str, package: str, model_path: Path) -> Side:
    from mlx_vlm import load

    def mod(*names: str) -> Any:
        for n in names:  # this layout's module, else the one before the package moved it
            try:
                return importlib.import_module(f"{package}.{n}")
            except ImportError:
                continue
        raise ImportError(f"{package}: none of {names}")

    text_model = mod("model.text_model", "text_model")
    try:
        scheduler = mod("text_engine.scheduler").BatchScheduler
        mtp = mod("text_engine.spec.mtp").MTPDecode
        request = mod("text_engine.state").TextRequest
    except (ImportError, AttributeError):  # a checkout from before the scheduler/runner split
        engine = mod("text_engine")
        scheduler, mtp, request = engine.BatchScheduler, engine.MTPDecode, engine.TextRequest
    options = mod("text_engine.sampling").SamplingOptions
    vlm, processor = load(str(model_path))
    bundle = text_model.build_text_model(vlm, model_path, json.loads((model_path / "config.json").read_text()))
    return Side(name, bundle, processor.tokenizer, scheduler, mtp, request, options)


def prompt(vocab: int, i: int, n: int) -> list[int]:
    return [(i * 7919 + j * 104729) % (vocab - 10) + 10 for j in range(n)]


def decode_batch(side: Side, B: int, mtp: bool) -> Any:
    decode = side.mtp(side.bundle.mtp, k=1, adaptive=False) if mtp else None
    sched = side.scheduler(side.bundle.model, side.tokenizer, max_num_seqs=B, prefill_step_size=2048, eos_token_ids=[],
                           decode=decode)
    sched.eos_ids = set()  # the rows never finish
    vocab = side.bundle.model.args.vocab_size
    for i in range(B):
        sched.add(side.request(str(i), prompt(vocab, i, 24), side.options(max_tokens=1 << 20)))
    while len(sched.running) < B:
        sched.step()
    for _ in range(3):
        sched.step()
    return sched


def timed_steps(sched: Any, n: int) -> tuple[float, float]:
    import mlx.core as mx

    tic, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        sched.step()
    mx.synchronize()
    return time.perf_counter() - tic, time.process_time() - cpu


def prefill_s(side: Side, n: int) -> float:
    import mlx.core as mx

    sched = side.scheduler(side.bundle.model, side.tokenizer, max_num_seqs=1, prefill_step_size=2048, eos_token_ids=[])
    vocab = side.bundle.model.args.vocab_size
    sched.add(side.request("p", prompt(vocab, 2, n), side.options(max_tokens=2)))
    tic = time.perf_counter()
    while not sched.running:
        sched.step()
    mx.synchronize()
    return time.perf_counter() - tic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the checkout to compare against")
    p.add_argument("--new", type=Path, default=ROOT, help="the checkout measured (default: this one)")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-qwen35-trained")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--blocks", type=int, default=12, help="alternating timed blocks per side and configuration")
    p.add_argument("--block", type=int, default=10, help="decode steps per block")
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    links = Path(tempfile.mkdtemp())
    for name, checkout in (("ab_base", args.base), ("ab_new", args.new)):
        os.symlink((checkout / "vllm_mlx_mtp_routing").resolve(), links / name)
    sys.path.insert(0, str(links))
    sides = [load_side("base", "ab_base", args.model), load_side("new", "ab_new", args.model)]
    result: dict[str, Any] = {"ratios_new_over_base": {}, "seconds": {}}
    for B in [int(b) for b in args.batches.split(",")]:
        for mtp in (False, True):
            key = f"{'mtp' if mtp else 'decode'}_b{B}"
            scheds = [decode_batch(s, B, mtp) for s in sides]
            wall, cpu = [0.0, 0.0], [0.0, 0.0]
            for blk in range(args.blocks):
                for i in (0, 1) if blk % 2 == 0 else (1, 0):
                    w, c = timed_steps(scheds[i], args.block)
                    wall[i] += w
                    cpu[i] += c
            steps = args.blocks * args.block
            result["seconds"][key] = {"base_step_ms": 1e3 * wall[0] / steps, "new_step_ms": 1e3 * wall[1] / steps}
            result["ratios_new_over_base"][key] = wall[1] / wall[0]
            result["ratios_new_over_base"][key + "_cpu"] = cpu[1] / cpu[0]
            print(f"{key}: base {1e3 * wall[0] / steps:.2f} ms/step, new {1e3 * wall[1] / steps:.2f} ms/step, "
                  f"new/base wall {wall[1] / wall[0]:.3f}, cpu {cpu[1] / cpu[0]:.3f}", flush=True)
            del scheds
    times: list[list[float]] = [[], []]
    for r in range(args.prefill_repeats + 1):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            t = prefill_s(sides[i], args.prefill_tokens)
            if r:  # the first of each compiles and allocates
                times[i].append(t)
    med = [statistics.median(t) for t in times]
    result["seconds"]["prefill"] = {"base_s": med[0], "new_s": med[1]}
    result["ratios_new_over_base"]["prefill"] = med[1] / med[0]
    print(f"prefill {args.prefill_tokens} tokens: base {med[0]:.2f} s, new {med[1]:.2f} s, new/base {med[1] / med[0]:.3f}")
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
