#!/usr/bin/env python3
"""Paired on/off A/B of the engine's decode-step options, in one process, at Qwen3.5 shapes with random weights.

Each option is a switch the engine has on by default where it was measured to pay; this measures it where it was
not (a GPU), or again:

- ``compiled_decode``: plain steps, the gated-delta decoder layers' compiled one-token step
  (model/kernels/compiled_decode.py) against mlx-lm's layer;
- ``compiled_verify``: MTP steps (``--draft-tokens`` drafts, default 1, every step, acceptance forced to 0.8), the
  verify's gated-delta decoder layers compiled (the same swap) against the package's uncompiled verify layer;
- ``fused_projections``: plain steps, projections of one input run as one matmul (model/kernels/fused_projections.py)
  against part by part, on the same weights;
- ``conv_step``: plain steps, the gated-delta layers' conv and its next window in one kernel
  (``causal_conv.conv_step``, CUDA) against the concatenation and the conv kernel;
- ``fused_layer``: plain steps, the gated-delta layers' conv, gates, head norms and recurrence in one kernel
  (model/kernels/gated_delta_layer.py, CUDA) against the ops and the conv and recurrence kernels (its values agree
  to rounding, so ``tokens_equal`` may be false on random weights);
- ``launch_early``: MTP steps (``--draft-tokens`` drafts, default 1, every step, acceptance forced to 0.8), the drafts
  and the verify started on the device as soon as each graph is built (``ModelRunner.launch_early``) against at the
  acceptance's read;
- ``kept_array``: MTP steps, the verify's kept gated-delta states left as the kernel's one array, the rollback
  gathering the kept ones (``backbone.kept_array_devices``, CUDA) against one array a position, stacked to gather.
- ``by_expert`` (plain steps) and ``by_expert_mtp`` (MTP steps): an MoE model's expert dispatch as measured at build
  against the plan had the expert kernel (model/kernels/expert_gemv.py, CUDA) not been timed.

The model takes the engine's layers for the device (the compiled step where ``swaps.compiled_decode_devices`` has it);
per batch size, two schedulers hold the same restored rows in steady decode; rounds of ``--block`` steps alternate
between them (order flipped every round), the option switched for the one that runs. Reported per option and batch:
the medians over rounds of on/off ratios of wall and CPU (process_time) seconds, each side's median ms per step, and
whether both sides' rows hold the same tokens at the end (``tokens_equal``: greedy, the same steps; an option the engine
turns on must keep it true).

  python benchmarks/decode_variants.py --shape 2b --out results/decode_variants_2b.json    # a GPU
  python benchmarks/decode_variants.py --smoke --out /tmp/decode_variants.json              # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtp_shapes_bench import Rows, load_tokenizer  # noqa: E402

import mlx.core as mx  # noqa: E402
from lib.provenance import commit, device, versions  # noqa: E402
from lib.random_model import build, text_config  # noqa: E402
from lib.shapes import PRESETS  # noqa: E402
from support.forced_acceptance import ForcedAcceptanceDecode  # noqa: E402
from vllm_mlx_mtp_routing.model import backbone  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels import causal_conv, fused_projections, gated_delta_layer, moe_dispatch  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels.compiled_decode import CompiledDecoderLayer, retrace  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels.device import kind  # noqa: E402
from vllm_mlx_mtp_routing.model.mlx_lm_internals import DecoderLayer  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.state import TextRequest  # noqa: E402

SHAPES = {"small": "tiny", "small-moe": "tiny-moe", "2b": "qwen35-2b", "9b": "qwen35-9b", "35b-a3b": "qwen35-35b-a3b"}
OPTIONS = ("compiled_decode", "compiled_verify", "fused_projections", "conv_step", "fused_layer", "launch_early",
           "kept_array", "by_expert", "by_expert_mtp")
MTP_OPTIONS = ("compiled_verify", "launch_early", "kept_array", "by_expert_mtp")  # timed on MTP steps, the rest on plain


def scheduler(model: Any, head: Any, tok: Any, rows: Rows, B: int, mtp: bool, k: int = 1) -> BatchScheduler:
    decode = ForcedAcceptanceDecode(head, 0.8, k=k, adaptive=False, seed=B) if mtp else None
    sched = BatchScheduler(model, tok, max_num_seqs=B, prefill_step_size=4096, eos_token_ids=[], decode=decode)
    sched.eos_ids = set()  # the rows never finish
    for i in range(B):
        sched.add(TextRequest(str(i), rows.prompts[i], SamplingOptions(max_tokens=1 << 20)), restored=rows.state(i))
    while len(sched.running) < B:
        sched.step()
    return sched


# Options that are this device's membership of a kernel's device set (read at each call: a test may swap the set)
DEVICE_SETS = {"conv_step": lambda: causal_conv.conv_step_devices,
               "fused_layer": lambda: gated_delta_layer.fused_layer_devices,
               "kept_array": lambda: backbone.kept_array_devices}
_detached: dict[int, dict] = {}  # the fused projections taken off a model while its "off" side runs
_measured_plans: dict[int, Any] = {}  # an MoE model's expert dispatch as built, while an "off" side runs without a way


def switch(option: str, model: Any, sched: BatchScheduler, on: bool, head: Any = None) -> None:
    if option in ("compiled_decode", "compiled_verify"):
        for layer in model.model.layers:
            if layer.is_linear:
                layer.__class__ = CompiledDecoderLayer if on else DecoderLayer
    elif option in DEVICE_SETS:
        devices = DEVICE_SETS[option]()
        (devices.add if on else devices.discard)(kind())
        retrace(model.model.layers)  # a compiled step traced one way: traced again
    elif option in ("by_expert", "by_expert_mtp"):
        plan = _measured_plans.setdefault(id(model), moe_dispatch.plan_of(model))
        if plan is not None:
            moe_dispatch.set_plan(plan if on else plan.without(moe_dispatch.BY_EXPERT), model, head)
    elif option == "fused_projections":
        if on:
            fused_projections.attach(_detached.pop(id(model), {}))
        else:
            _detached.setdefault(id(model), {}).update(fused_projections.detach(model))
        retrace(model.model.layers)  # the compiled steps traced with the projections as they were
    else:
        sched.runner.launch_early = on


def steps(sched: BatchScheduler, n: int) -> tuple[float, float]:
    sched.step()  # the first after a switch pays for it
    mx.synchronize()
    tic, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        sched.step()
    mx.synchronize()
    return (time.perf_counter() - tic) / n, (time.process_time() - cpu) / n


def measure(option: str, model: Any, head: Any, tok: Any, rows: Rows, B: int, rounds: int, block: int,
            k: int = 1) -> dict:
    mtp = option in MTP_OPTIONS
    classes = [type(layer) for layer in model.model.layers]  # as the model was built: restored after
    devices = {name: set(members()) for name, members in DEVICE_SETS.items()}  # likewise
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    try:
        scheds = {on: scheduler(model, head, tok, rows, B, mtp, k) for on in (False, True)}
        for on in (False, True):  # warm-up: each side's kernels compiled, its graphs traced
            switch(option, model, scheds[on], on, head)
            steps(scheds[on], 3)
        for r in range(rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                switch(option, model, scheds[on], on, head)
                w, c = steps(scheds[on], block)
                wall[on].append(w)
                cpu[on].append(c)
        # Both sides decoded the same rows greedily for as many steps: an exact option leaves the same tokens.
        same = tokens(scheds[True]) == tokens(scheds[False])
    finally:
        for layer, cls in zip(model.model.layers, classes):
            layer.__class__ = cls
        fused_projections.attach(_detached.pop(id(model), {}))
        if id(model) in _measured_plans:
            moe_dispatch.set_plan(_measured_plans.pop(id(model)), model, head)
        for name, members in DEVICE_SETS.items():
            members().clear()
            members().update(devices[name])
        retrace(model.model.layers)
    ratio = lambda xs: statistics.median(a / b for a, b in zip(xs[True], xs[False]))  # noqa: E731
    return {
        "batch": B, "option": option, "rounds": rounds, "block": block, "draft_tokens": k if mtp else 0,
        "on_over_off_wall": round(ratio(wall), 4), "on_over_off_cpu": round(ratio(cpu), 4),
        "off_ms": round(1e3 * statistics.median(wall[False]), 3), "on_ms": round(1e3 * statistics.median(wall[True]), 3),
        "off_cpu_ms": round(1e3 * statistics.median(cpu[False]), 3), "on_cpu_ms": round(1e3 * statistics.median(cpu[True]), 3),
        "tokens_equal": same,
    }


def tokens(sched: BatchScheduler) -> list[list[int]]:
    """Each row's tokens so far, by request id."""
    return [list(row.token_ids) for row in sorted(sched.running, key=lambda row: row.rid)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--draft-tokens", type=int, default=1, help="drafts a step for the MTP options")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="a CPU check: tiny shape, batches 1,2, 2 rounds of 2 steps")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.smoke:  # its defaults; arguments given still win
        ap.set_defaults(shape="small", batches="1,2", rounds=2, block=2, prompt_tokens=16)
        a = ap.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    options = [o for o in a.options.split(",") if o]
    unknown = set(options) - set(OPTIONS)
    if unknown:
        ap.error(f"--options: unknown {sorted(unknown)}; choose from {', '.join(OPTIONS)}")
    tok, tok_size, special = load_tokenizer()
    shape = text_config(PRESETS[SHAPES[a.shape]])
    # the engine's layers for this device (swaps.apply), as a loaded checkpoint gets them
    model, head = build(shape, getattr(mx, a.dtype), sorted(set(range(tok_size, shape["vocab_size"])) | set(special)))
    usable = [i for i in range(10, tok_size) if i not in set(special)]
    rng = __import__("random").Random(0)
    rows = Rows(model, head, [[rng.choice(usable) for _ in range(a.prompt_tokens)] for _ in range(max(batches))])
    result: dict[str, Any] = {"benchmark": "decode_variants", "shape": a.shape, "dtype": a.dtype, "commit": commit(),
                              "device": device(), "versions": versions(), "rows": []}
    for option in options:
        for B in batches:
            try:
                row = measure(option, model, head, tok, rows, B, a.rounds, a.block, a.draft_tokens)
            except Exception as e:  # an option that fails here is a finding too: the others still run
                row = {"batch": B, "option": option, "error": f"{type(e).__name__}: {e}"}
            result["rows"].append(row)
            print("decode_variants: " + json.dumps(row), flush=True)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
