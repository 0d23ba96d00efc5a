#!/usr/bin/env python3
"""Where an engine decode step's wall time goes, plain against MTP, phase by phase.

decode_loops.py says an MTP step costs more than its extra kernels explain; this says where. Per batch size, each
side keeps B rows decoding (forced acceptance ``--acceptance`` on the MTP sides, as decode_loops.py) and its steps
are timed with the engine's phases wrapped in wall-clock timers:

  plain   launch (the step's graph built and started), read_wait (waiting for the step launched before it),
          read (its tokens to the host, the head's pairs under MTP)
  MTP     propose (the head's drafts built and started), verify_build (the verify's graph built, started in pieces
          of ``launch_layers``), verify_wait (waiting for the verify's logits: the device time the host did not hide),
          accept (the acceptance built and read), rollback, after_verify (the head's pending pairs)

``other`` is the rest of the scheduler's step (planning, streaming bookkeeping, the final ``async_eval``). To split
the wait from the acceptance, the wrapper evaluates the verify's logits before the acceptance's graph is built: one
more short round trip per MTP step than the engine makes, so the MTP sides here run slightly slower than in
decode_loops.py. Sides: ``plain``, ``mtp`` (the engine's launch pieces) and ``mtp_pieces0`` (the verify started at
once). Medians over ``--rounds`` alternated rounds.

  python benchmarks/mtp_step_phases.py --shape small-moe --batches 1,4 --out /tmp/phases.json          # CPU
  python benchmarks/mtp_step_phases.py --shape 35b-a3b --batches 1,8 --out phases_gpu.json             # GPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode_loops puts the repository and tests/ on the path
import decode_loops as dl
import mlx.core as mx

from vllm_mlx_mtp_routing.model.kernels import moe_dispatch
from vllm_mlx_mtp_routing.model.kernels.device import kind
from vllm_mlx_mtp_routing.text_engine.spec import verify


class Phases:
    """Wall seconds per phase, accumulated while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = defaultdict(float)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
        return wrapper

    def wait(self, name: str, arrays: Any) -> None:
        if self.on:
            t = time.perf_counter()
            mx.eval(arrays)
            self.seconds[name] += time.perf_counter() - t


def instrument(loop: dl.EngineLoop, phases: Phases) -> None:
    """Wrap one side's runner and MTP parts (instance attributes: the other sides keep theirs)."""
    runner = loop.sched.runner
    runner._launch = phases.timed("launch", runner._launch)
    read = phases.timed("read", runner._read)

    def read_after_wait(step: Any) -> Any:
        phases.wait("read_wait", step.sampled)
        return read(step)

    runner._read = read_after_wait
    spec = runner.spec
    if spec is None:
        return
    spec.proposer.propose = phases.timed("propose", spec.proposer.propose)
    spec.proposer.after_verify = phases.timed("after_verify", spec.proposer.after_verify)
    accept = phases.timed("accept", spec.accept)

    def accept_after_wait(logits: mx.array, *args: Any) -> Any:
        phases.wait("verify_wait", logits)
        return accept(logits, *args)

    spec.accept = accept_after_wait


@contextlib.contextmanager
def verify_timed(phases_of: Callable[[], Phases]) -> Iterator[None]:
    """verify.forward / roll_back are module functions the runner calls through the module: timed for the side whose
    phases are on while this lasts, the module's own put back after (nothing stays patched between batch sizes)."""
    forward, roll_back = verify.forward, verify.roll_back
    verify.forward = lambda *a, **k: phases_of().timed("verify_build", forward)(*a, **k)
    verify.roll_back = lambda *a, **k: phases_of().timed("rollback", roll_back)(*a, **k)
    try:
        yield
    finally:
        verify.forward, verify.roll_back = forward, roll_back


def at_batch(loaded: dl.Loaded, B: int, a: argparse.Namespace) -> dict[str, Any]:
    from support.forced_acceptance import ForcedAcceptanceDecode

    prompts = dl.prompts_for(loaded, B, a.prompt_tokens, seed=B)
    sides: dict[str, tuple[bool, int | None]] = {"plain": (False, None), "mtp": (True, None), "mtp_pieces0": (True, 0)}
    loops: dict[str, dl.EngineLoop] = {}
    phases: dict[str, Phases] = {}
    for name, (mtp, launch_layers) in sides.items():
        decode = ForcedAcceptanceDecode(loaded.head, a.acceptance, k=1, adaptive=False, seed=B) if mtp else None
        loops[name] = loop = dl.EngineLoop(loaded, prompts, decode)
        if launch_layers is not None:
            loop.sched.runner.launch_layers = launch_layers
        phases[name] = Phases()
        instrument(loop, phases[name])
    current = {"side": "plain"}
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    with verify_timed(lambda: phases[current["side"]]):
        for r in range(a.rounds + 1):  # round 0 warms up
            for name in (list(sides) if r % 2 else list(sides)[::-1]):
                loop, ph = loops[name], phases[name]
                current["side"] = name
                gc.collect()
                dl.drain()
                ph.seconds.clear()
                before = loop.tokens
                ph.on = True
                t = time.perf_counter()
                for _ in range(a.steps):
                    loop.step()
                dl.drain()
                wall = time.perf_counter() - t
                ph.on = False
                if r:
                    got = {k: 1e3 * v / a.steps for k, v in ph.seconds.items()}
                    got["step"] = 1e3 * wall / a.steps
                    got["other"] = got["step"] - sum(v for k, v in got.items() if k != "step")
                    got["tokens_per_step"] = (loop.tokens - before) / a.steps
                    per_round[name].append(got)
    row: dict[str, Any] = {"batch": B}
    for name, rounds in per_round.items():
        keys = sorted({k for got in rounds for k in got})
        row[name] = {k: round(statistics.median(got.get(k, 0.0) for got in rounds), 3) for k in keys}
    for name in ("mtp", "mtp_pieces0"):
        per_token = row[name]["step"] / row[name]["tokens_per_step"]
        row[f"{name}_over_plain"] = round(row["plain"]["step"] / row["plain"]["tokens_per_step"] / per_token, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small-moe", choices=[s for s in dl.SHAPES if s != "trained"])
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=32, help="steps per side per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--acceptance", type=float, default=0.8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    dtype = "float32" if kind() == "cpu" else "bfloat16"
    t0 = time.perf_counter()
    loaded = dl.load(a.shape, a.layers or None, dtype)
    result: dict[str, Any] = {"benchmark": "mtp_step_phases", "commit": dl.commit(), "device": dl.device(),
                              "versions": dl.versions(), "shape": a.shape,
                              "layers": loaded.config["num_hidden_layers"], "build_s": round(time.perf_counter() - t0, 1),
                              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}, "rows": []}
    plan = moe_dispatch.plan_of(loaded.model)
    if plan is not None:
        result["moe_dispatch"] = plan.describe()
    for B in [int(b) for b in a.batches.split(",") if b]:
        row = at_batch(loaded, B, a)
        result["rows"].append(row)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print("mtp_step_phases: " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
