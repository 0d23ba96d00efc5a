#!/usr/bin/env python3
"""The text engine's plain decode step beside mlx-lm's own decode loops, on one model object (the same weights).

Per shape and batch size B, in one process, with B rows decoding and none finishing:

  engine           the engine's plain decoding through the scheduler's public API (``BatchScheduler.add`` /
                   ``step``, ``decode=None``), with the layer classes the engine gives a loaded model (swaps.py)
  engine_stock     the same with mlx-lm's own layer classes put back (what the engine's swaps are worth)
  generate_step    mlx-lm 0.31.3's ``generate_step`` (B = 1), which launches step N+1 before reading step N
  batch_generator  mlx-lm 0.31.3's ``BatchGenerator`` (B rows in one generation batch), which pipelines likewise

(mlx-lm's loops run with mlx-lm's own layer classes.) Each loop's seconds per step (one token per row) are timed in
``--repeats`` blocks of ``--steps`` steps, the loops alternating block by block, and the median block is reported
with its CPU seconds per step (``time.process_time``: graph build + encoding/launching, and on MLX's CPU backend the
compute itself) and the main thread's (``time.thread_time``). On CUDA one more block per loop reads the device's
busy time per step and its kernels per step from CUPTI, with the most launched kernels and those that took the most
device time, by name (lib/device_busy.py; n/a without cupti-python, and on the CPU, where the device is the CPU). The
bandwidth bound of a step is the bytes it must read over the memory bandwidth: every weight a token touches (lm_head
whole, the embedding's B rows; MoE: the routed experts the step actually touched, counted on one engine step, plus the
shared expert), the KV cache of the attention layers at the context length and the gated-delta layers' state.

With ``--mtp-batches``: MTP on against plain decoding in the engine at forced acceptance ``--acceptance``
(support/forced_acceptance.py: the verify agrees with each draft with probability a; k = 1, every row drafting),
per batch size, plain and MTP alternating over ``--mtp-rounds`` rounds; the speedup is the median of the rounds'
tokens/s ratios. For MoE shapes, ``--dispatch`` lists the expert dispatch plans to run it under: the one the model's
build measured (model/kernels/moe_dispatch.py; its per-size times are in the JSON) and mlx-lm's rule.

Shapes: ``small`` (the trained tiny model's shape, random weights), ``small-moe`` (it with MoE blocks) and ``trained`` (models/tiny-qwen35-trained, loaded as the
server loads it) for the CPU; ``2b``, ``9b``, ``35b-a3b`` (40 layers, 256 experts, 8 routed + a shared one;
``--layers N`` builds N of them) for a GPU. Random shapes have random weights in ``--dtype``, built in memory.

  python benchmarks/decode_loops.py --shapes small,trained --out benchmarks/results/decode_loops_cpu.json
  python benchmarks/decode_loops.py --shapes 35b-a3b --layers 20 --mtp-batches 1,2,4,8 --out loops_moe.json   # GPU
The JSON records the commit, device and versions, and is rewritten after every batch size.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test support package: support.*
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from lib.device_busy import DeviceBusy  # noqa: E402
from lib.provenance import commit, device, gpu_names, versions  # noqa: E402
from lib.random_model import build, parameter_count, text_config  # noqa: E402
from lib.shapes import PRESETS  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels import moe_dispatch  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels.device import kind  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.state import TextRequest  # noqa: E402

TRAINED = ROOT / "models" / "tiny-qwen35-trained"
SHAPES = {"small": "tiny", "small-moe": "tiny-moe", "2b": "qwen35-2b", "9b": "qwen35-9b", "35b-a3b": "qwen35-35b-a3b", "trained": None}
LOOPS = ("engine", "engine_stock", "generate_step", "batch_generator")
# Published peak memory bandwidth (bytes/s) by GPU name; elsewhere the bound uses the bandwidth measured here.
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


# -- the model -------------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    name: str
    model: Any
    head: Any
    tokenizer: Any
    config: dict
    random_weights: bool
    usable_ids: list[int]


def _tokenizer(vocab: int) -> tuple[Any, list[int], list[int]]:
    """The trained tiny model's tokenizer, the ids prompts draw from, and the ids greedy decoding must not emit."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(TRAINED)
    size = len(tok.get_vocab())
    special = set(tok.all_special_ids) | set(tok.eos_token_ids)
    return tok, [i for i in range(10, size) if i not in special], sorted(special | set(range(size, vocab)))


def load(name: str, layers: int | None, dtype: str) -> Loaded:
    if name == "trained":
        from mlx_vlm import load as vlm_load

        from vllm_mlx_mtp_routing.model.text_model import build_text_model

        vlm, processor = vlm_load(str(TRAINED))
        config = json.loads((TRAINED / "config.json").read_text())
        bundle = build_text_model(vlm, TRAINED, config)
        tok = processor.tokenizer
        eos = tok.eos_token_ids if tok.eos_token_ids is not None else []
        special = set(tok.all_special_ids) | set([eos] if isinstance(eos, int) else eos)
        usable = [i for i in range(10, len(tok.get_vocab())) if i not in special]
        return Loaded(name, bundle.model, bundle.mtp, tok, config["text_config"], False, usable)
    config = text_config(PRESETS[SHAPES[name]], layers)
    tok, usable, zero_ids = _tokenizer(config["vocab_size"])
    model, head = build(config, getattr(mx, dtype), zero_ids)
    return Loaded(name, model, head, tok, config, True, usable)


def _stock(cls: type) -> type:
    """The nearest base class that is mlx-lm's (or MLX's) own; MLX's CPU backend needs the float32 experts kept."""
    if cls.__module__.endswith("cpu_experts"):
        return cls
    while cls.__module__.startswith("vllm_mlx_mtp_routing"):
        cls = cls.__bases__[0]
    return cls


@contextlib.contextmanager
def stock_classes(*roots: Any) -> Iterator[None]:
    """mlx-lm's layer classes in place of the engine's swapped ones, restored after."""
    changed = []
    for root in roots:
        for _, m in root.named_modules():
            stock = _stock(type(m))
            if stock is not type(m):
                changed.append((m, type(m)))
                m.__class__ = stock
    try:
        yield
    finally:
        for m, cls in changed:
            m.__class__ = cls


# -- the loops -------------------------------------------------------------------------------------------------


class EngineLoop:
    """B rows in the engine's scheduler, prefilled and decoding, never finishing; ``step()`` is one decode step."""

    def __init__(self, loaded: Loaded, prompts: list[list[int]], decode: Any = None, max_tokens: int = 1 << 30) -> None:
        self.sched = BatchScheduler(loaded.model, loaded.tokenizer, max_num_seqs=len(prompts), prefill_step_size=2048,
                                    eos_token_ids=[], decode=decode)
        self.sched.eos_ids = set()
        for i, p in enumerate(prompts):
            self.sched.add(TextRequest(str(i), p, SamplingOptions(max_tokens=max_tokens)))
        self.tokens = 0
        while len(self.sched.running) < len(prompts):
            self.step()

    def step(self) -> None:
        for o in self.sched.step():
            self.tokens += len(o.new_token_ids)


class GenerateStepLoop:
    def __init__(self, loaded: Loaded, prompts: list[list[int]]) -> None:
        from mlx_lm.generate import generate_step

        assert len(prompts) == 1
        self.gen = generate_step(mx.array(prompts[0], dtype=mx.uint32), loaded.model, max_tokens=-1)
        next(self.gen)

    def step(self) -> None:
        next(self.gen)


class BatchGeneratorLoop:
    def __init__(self, loaded: Loaded, prompts: list[list[int]]) -> None:
        from mlx_lm.generate import BatchGenerator

        B = len(prompts)
        self.gen = BatchGenerator(loaded.model, max_tokens=1 << 30, completion_batch_size=B, prefill_batch_size=B)
        self.gen.insert(prompts)
        for _ in range(10_000):
            if len(self.gen.next()[1]) == B:
                return
        raise RuntimeError("BatchGenerator never had every row generating")

    def step(self) -> None:
        self.gen.next()


def make_loop(name: str, loaded: Loaded, prompts: list[list[int]]) -> Any:
    if name in ("engine", "engine_stock"):
        return EngineLoop(loaded, prompts)
    return GenerateStepLoop(loaded, prompts) if name == "generate_step" else BatchGeneratorLoop(loaded, prompts)


def classes_for(name: str, loaded: Loaded) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if name == "engine" else stock_classes(loaded.model, loaded.head)


def drain() -> None:
    """Wait for the device's work on every stream a loop uses (mlx-lm's loops run on their own)."""
    from mlx_lm.generate import generation_stream

    mx.synchronize()
    mx.synchronize(generation_stream)


def timed_block(loop: Any, steps: int) -> tuple[float, float, float]:
    """Seconds per step of ``steps`` steps: wall, process CPU, main-thread CPU. The device is drained first (no other
    loop's step still runs), then one untimed step puts a pipelined loop back in its steady state."""
    drain()
    loop.step()
    t, c, th = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        loop.step()
    return ((time.perf_counter() - t) / steps, (time.process_time() - c) / steps, (time.thread_time() - th) / steps)


# -- what a step reads -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def counting_experts(model: Any) -> Iterator[list[int]]:
    """Each MoE layer's call appends how many distinct experts its tokens routed to (one eval per call)."""
    import numpy as np

    counts: list[int] = []
    changed = []
    for _, m in model.named_modules():
        if hasattr(m, "gate_proj") and hasattr(m, "down_proj") and type(m).__name__.endswith("SwitchGLU"):
            cls = type(m)

            def call(self: Any, x: mx.array, indices: mx.array, _cls: type = cls) -> mx.array:
                counts.append(int(np.unique(np.array(indices)).size))
                return _cls.__call__(self, x, indices)

            m.__class__ = type(f"Counting{cls.__name__}", (cls,), {"__call__": call})
            changed.append((m, cls))
    try:
        yield counts
    finally:
        for m, cls in changed:
            m.__class__ = cls


def step_bytes(loaded: Loaded, B: int, context: int, distinct: list[int]) -> dict:
    """Bytes one plain step of B rows reads: weights (MoE: the touched experts), KV cache and recurrent state."""
    cfg = loaded.config
    weights = experts = 0
    for name, v in tree_flatten(loaded.model.parameters()):
        if name.endswith("embed_tokens.weight") and not cfg.get("tie_word_embeddings"):
            weights += B * v.shape[-1] * v.itemsize  # a gather of B rows
        elif ".switch_mlp." in name:
            experts += v.nbytes
        else:
            weights += v.nbytes
    moe_layers = cfg["num_hidden_layers"] if cfg.get("num_experts") else 0
    touched = 0.0
    if moe_layers:
        per_expert = experts / moe_layers / cfg["num_experts"]
        touched = per_expert * (sum(distinct) if distinct else moe_layers * min(cfg["num_experts"], B * cfg["num_experts_per_tok"]))
    itemsize = loaded.model.model.embed_tokens.weight.itemsize
    n_attn = cfg["num_hidden_layers"] // cfg["full_attention_interval"]
    n_lin = cfg["num_hidden_layers"] - n_attn
    kv = n_attn * 2 * B * context * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize
    conv_dim = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    state = n_lin * B * (cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"] * cfg["linear_key_head_dim"] * 4
                         + (cfg["linear_conv_kernel_dim"] - 1) * conv_dim * itemsize)
    return {"weights": int(weights + touched), "moe_experts_touched": int(touched), "kv_cache": int(kv),
            "recurrent_state": int(state), "total": int(weights + touched + kv + state)}


def measured_bandwidth() -> tuple[float, str]:
    """Bytes/s of a sum over one large float32 array (reads only), and how it was taken: MLX's on a GPU, NumPy's on
    the CPU (MLX's CPU reduction runs at a fraction of the memory's pace)."""
    import numpy as np

    n = (1 << 29) if kind() != "cpu" else (1 << 26)
    if kind() != "cpu":
        a = mx.ones((n,), dtype=mx.float32)
        mx.eval(a)
        run: Any = lambda: mx.eval(mx.sum(a))  # noqa: E731
        how = "MLX sum over 2 GiB"
    else:
        b = np.ones(n, dtype=np.float32)
        run = b.sum
        how = "NumPy sum over 256 MiB, one core"
    times = []
    for _ in range(8):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return 4 * n / min(times[1:]), how  # the least disturbed run: a shared machine only ever slows it


def bandwidth() -> tuple[float, str, float]:
    """(bytes/s the bound uses, where it comes from, the measured one)."""
    measured, how = measured_bandwidth()
    names = gpu_names() if kind() == "cuda" else ""
    for gpu, bw in SPEC_BANDWIDTH.items():
        if gpu in names:
            return bw, f"{gpu} published peak {bw / 1e12:.2f} TB/s", measured
    return measured, f"measured here ({how}): {measured / 1e9:.1f} GB/s", measured


# -- one batch size --------------------------------------------------------------------------------------------


def prompts_for(loaded: Loaded, B: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(loaded.usable_ids) for _ in range(n)] for _ in range(B)]


def per_step_names(busy: DeviceBusy, steps: int, top: int = 40) -> dict[str, float]:
    """The last traced window's most launched kernels, per step: which kernels a step's launches go to."""
    return {name: round(n / steps, 2) for name, n in busy.kernel_names.most_common(top)}


def per_step_times(busy: DeviceBusy, steps: int, top: int = 25) -> dict[str, float]:
    """The last traced window's kernels that took the most device time, ms per step: where its busy time goes."""
    return {name: round(1e3 * t / steps, 4) for name, t in busy.kernel_seconds.most_common(top)}


def loops_at(loaded: Loaded, B: int, a: argparse.Namespace, busy: DeviceBusy, bw: float) -> dict:
    names = [n for n in a.loops if n != "generate_step" or B == 1]
    prompts = prompts_for(loaded, B, a.prompt_tokens)
    loops = {}
    for name in names:
        with classes_for(name, loaded):
            loops[name] = make_loop(name, loaded, prompts)
            for _ in range(a.warmup):
                loops[name].step()
    times: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for r in range(a.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            busy.quiesce()
            with classes_for(name, loaded):
                times[name].append(timed_block(loops[name], a.steps))
    row: dict[str, Any] = {"batch": B}
    for name in names:
        order = sorted(times[name])
        wall, cpu, thread = order[len(order) // 2]
        row[name] = {"step_ms": round(1e3 * wall, 3), "cpu_ms": round(1e3 * cpu, 3), "thread_cpu_ms": round(1e3 * thread, 3),
                     "step_ms_blocks": [round(1e3 * t[0], 3) for t in times[name]]}
        if busy.available():
            with classes_for(name, loaded):
                drain()
                busy.start()
                for _ in range(a.steps):
                    loops[name].step()
                drain()
                got = busy.stop()
            if got is None:
                row[name]["device_busy"] = busy.why
            else:
                row[name]["device_busy_ms"] = round(1e3 * got[0] / a.steps, 3)
                row[name]["kernels_per_step"] = round(got[1] / a.steps, 1)
                row[name]["kernels_per_step_by_name"] = per_step_names(busy, a.steps)
                row[name]["device_ms_per_step_by_name"] = per_step_times(busy, a.steps)
    distinct: list[int] = []
    if loaded.config.get("num_experts"):
        # mlx-lm's classes for this one step: the engine's compiled layers would not call the switch from Python
        with stock_classes(loaded.model, loaded.head), counting_experts(loaded.model) as distinct:
            loops["engine"].step()
    context = a.prompt_tokens + a.warmup + (a.repeats + 1) * (a.steps + 1)
    row["bytes_per_step"] = step_bytes(loaded, B, context, distinct)
    if distinct:
        row["moe_distinct_experts_per_layer"] = round(statistics.mean(distinct), 1)
    row["bandwidth_bound_ms"] = round(1e3 * row["bytes_per_step"]["total"] / bw, 3)
    eng = row["engine"]["step_ms"]
    for name in names:
        if name != "engine":
            row[f"engine_over_{name}"] = round(eng / row[name]["step_ms"], 3)
    del loops
    gc.collect()
    mx.clear_cache()
    return row


# -- MTP on against plain ---------------------------------------------------------------------------------------


def mtp_against_plain(loaded: Loaded, B: int, a: argparse.Namespace, busy: DeviceBusy) -> dict:
    """MTP on against plain at batch ``B``: tokens/s of alternated rounds, and what a step of each costs (wall, process
    CPU and, under CUPTI, the device's busy time per step; medians over the rounds), so a step that costs more than its
    tokens pay for shows whether the device or the CPU grew. Each side keeps its B rows decoding, none finishing, from
    round to round (a row prefilling beside decoding ones, or a batch that shrinks, would be another measurement)."""
    from support.forced_acceptance import ForcedAcceptanceDecode

    prompts = prompts_for(loaded, B, a.prompt_tokens, seed=B)
    # The sides of a round: plain, MTP as the engine runs it, and with --mtp-launch-layers MTP whose verify starts in
    # pieces of that many layers (0: all at once).
    # With --mtp-ks, MTP drafting that many tokens a step (acceptance forced per draft, so k drafts keep a prefix).
    # With --mtp-auto K, the server's adaptive schedule choosing 0 to K drafts a step (it learns in the warm-up round).
    sides: dict[str, tuple[int, int | None, bool]] = {"plain": (0, None, False), "mtp": (1, None, False)}
    for n in a.mtp_launch_layers:
        sides[f"mtp_pieces{n}"] = (1, n, False)
    for k in a.mtp_ks:
        sides[f"mtp_k{k}"] = (k, None, False)
    if a.mtp_auto:
        sides["mtp_auto"] = (a.mtp_auto, None, True)
    loops: dict[str, EngineLoop] = {}
    for name, (k, launch_layers, adaptive) in sides.items():
        decode = ForcedAcceptanceDecode(loaded.head, a.acceptance, k=k, adaptive=adaptive, choose_count=adaptive,
                                        seed=B) if k else None
        loops[name] = loop = EngineLoop(loaded, prompts, decode)
        if launch_layers is not None:  # else the engine's own
            loop.sched.runner.launch_layers = launch_layers

    def run(name: str, traced: bool = False) -> dict:
        loop = loops[name]
        drain()
        busy.quiesce()
        before = loop.tokens
        if traced:
            busy.start()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(a.mtp_steps):
            loop.step()
        drain()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        got = busy.stop() if traced else None
        decode = loop.sched.spec
        out = {"tok_s": (loop.tokens - before) / wall, "step_ms": 1e3 * wall / a.mtp_steps,
               "cpu_ms": 1e3 * cpu / a.mtp_steps, "stats": decode.stats() if decode is not None else {}}
        if got is not None:
            out["device_busy_ms"], out["kernels_per_step"] = 1e3 * got[0] / a.mtp_steps, got[1] / a.mtp_steps
        return out

    t_rounds = time.perf_counter()
    ratios: dict[str, list[float]] = {name: [] for name in sides if name != "plain"}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(a.mtp_rounds + 1):  # round 0 warms up
        order = list(sides) if r % 2 else list(sides)[::-1]
        got = {}
        for name in order:
            gc.collect()
            got[name] = run(name)
        if r:
            for name in sides:
                runs[name].append(got[name])
                if name != "plain":
                    ratios[name].append(got[name]["tok_s"] / got["plain"]["tok_s"])
    row: dict[str, Any] = {"batch": B, "speedup": round(statistics.median(ratios["mtp"]), 3),
                           "speedup_rounds": [round(x, 3) for x in ratios["mtp"]]}
    if a.mtp_auto:
        row["speedup_auto"] = round(statistics.median(ratios["mtp_auto"]), 3)
        row["speedup_auto_rounds"] = [round(x, 3) for x in ratios["mtp_auto"]]
        policy = runs["mtp_auto"][-1]["stats"]
        row["auto_policy"] = {key: policy.get(key) for key in ("draft_count_by_batch", "draft_cost_by_count",
                                                               "position_acceptance_estimate", "steps_without_mtp")}
    for k in a.mtp_ks:
        row[f"speedup_k{k}"] = round(statistics.median(ratios[f"mtp_k{k}"]), 3)
        row[f"speedup_k{k}_rounds"] = [round(x, 3) for x in ratios[f"mtp_k{k}"]]
    for n in a.mtp_launch_layers:
        row[f"speedup_pieces{n}"] = round(statistics.median(ratios[f"mtp_pieces{n}"]), 3)
        row[f"speedup_pieces{n}_rounds"] = [round(x, 3) for x in ratios[f"mtp_pieces{n}"]]
    for name, rs in runs.items():
        row[f"{name}_tok_s"] = [round(x["tok_s"], 2) for x in rs]
        for key in ("step_ms", "cpu_ms"):
            row[f"{name}_{key}"] = round(statistics.median(x[key] for x in rs), 3)
    row["acceptance"] = round(runs["mtp"][-1]["stats"].get("acceptance_rate", 0.0), 3)
    row["rounds_s"] = round(time.perf_counter() - t_rounds, 1)
    t_traced = time.perf_counter()
    if busy.available():  # one more run each way, traced: the device's share of a step
        for name in sides:
            traced = run(name, traced=True)
            if "device_busy_ms" in traced:
                row[f"{name}_device_busy_ms"] = round(traced["device_busy_ms"], 3)
                row[f"{name}_kernels_per_step"] = round(traced["kernels_per_step"], 1)
                row[f"{name}_kernels_per_step_by_name"] = per_step_names(busy, a.mtp_steps)
                row[f"{name}_device_ms_per_step_by_name"] = per_step_times(busy, a.mtp_steps)
        row["traced_s"] = round(time.perf_counter() - t_traced, 1)
    return row


# -- the run ---------------------------------------------------------------------------------------------------


def _more_ks(m: dict) -> str:
    """The other draft counts' MTP / plain, after k = 1's."""
    more = "".join(f" (k = {key[len('speedup_k'):]}: {v:.3f})" for key, v in m.items()
                   if key.startswith("speedup_k") and not key.endswith("_rounds"))
    if "speedup_auto" in m:
        more += f" (adaptive: {m['speedup_auto']:.3f}, counts {m['auto_policy']['draft_count_by_batch']})"
    return more


def table(result: dict) -> str:
    lines = ["| shape | B | engine ms | engine, stock classes | generate_step | BatchGenerator | engine / generate_step "
             "| engine / BatchGenerator | CPU ms/step: engine / gs / BG | device busy ms: engine / gs / BG | bound ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(row: dict, name: str, key: str) -> str:
        v = row.get(name, {}).get(key)
        return "-" if v is None else f"{v:.2f}"

    for shape in result["shapes"]:
        for row in shape["rows"]:
            names = ("engine", "generate_step", "batch_generator")
            lines.append(
                f"| {shape['label']} | {row['batch']} | {cell(row, 'engine', 'step_ms')} | {cell(row, 'engine_stock', 'step_ms')} "
                f"| {cell(row, 'generate_step', 'step_ms')} | {cell(row, 'batch_generator', 'step_ms')} "
                f"| {row.get('engine_over_generate_step', '-')} | {row.get('engine_over_batch_generator', '-')} "
                f"| {' / '.join(cell(row, n, 'cpu_ms') for n in names)} "
                f"| {' / '.join(cell(row, n, 'device_busy_ms') for n in names)} | {row['bandwidth_bound_ms']:.2f} |")
    mtp = [(s["label"], m) for s in result["shapes"] for m in s.get("mtp", [])]
    if mtp:
        lines += ["", "| shape | dispatch | B | MTP / plain | acceptance | rounds | step ms: plain / MTP "
                  "| CPU ms/step: plain / MTP | device busy ms: plain / MTP |", "|" + " --- |" * 9]
        lines += [f"| {label} | {m.get('dispatch', '-')} | {m['batch']} | {m['speedup']:.3f}{_more_ks(m)} | {m['acceptance']} "
                  f"| {m['speedup_rounds']} | {m.get('plain_step_ms', '-')} / {m.get('mtp_step_ms', '-')} "
                  f"| {m.get('plain_cpu_ms', '-')} / {m.get('mtp_cpu_ms', '-')} "
                  f"| {m.get('plain_device_busy_ms', '-')} / {m.get('mtp_device_busy_ms', '-')} |" for label, m in mtp]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="small,trained", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of the random shapes (0: the shape's own)")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--steps", type=int, default=16, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=3, help="timed blocks per loop (the median is reported)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps per loop after its prefill")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--mtp-batches", default="", help="also MTP on vs plain at these batch sizes (e.g. 1,2,4,8)")
    ap.add_argument("--acceptance", type=float, default=0.8, help="forced acceptance of the MTP runs")
    ap.add_argument("--mtp-steps", type=int, default=32, help="steps of each MTP / plain run")
    ap.add_argument("--mtp-rounds", type=int, default=3)
    ap.add_argument("--mtp-ks", default="", type=lambda v: [int(x) for x in v.split(",") if x and x != "1"],
                    help="also MTP drafting these many tokens a step (comma list; k = 1 is always run)")
    ap.add_argument("--mtp-auto", type=int, default=0, metavar="K",
                    help="also the adaptive schedule choosing 0 to K drafts a step, as the server runs it")
    ap.add_argument("--mtp-launch-layers", default="", type=lambda v: [int(x) for x in v.split(",") if x],
                    help="also MTP with its verify started every N layers while the rest is built (0: at once), per N "
                    "of this comma list")
    ap.add_argument("--dispatch", default="measured,mlx-lm",
                    help="MoE shapes: the expert dispatch plans the MTP runs go under (measured: the plan measured at build; "
                         "mlx-lm: mlx-lm's rule, sort from 64 pairs)")
    ap.add_argument("--dtype", default="", help="random shapes' dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no batch size after this many seconds (0: none)")
    ap.add_argument("--no-cupti", action="store_true", help="no device busy time (CUPTI's tracing off for the run)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.loops = [n for n in a.loops.split(",") if n]
    if not a.loops or "engine" not in a.loops or not set(a.loops) <= set(LOOPS):
        ap.error(f"--loops: a comma list of {', '.join(LOOPS)} that includes engine")
    shapes = [s for s in a.shapes.split(",") if s]
    if not shapes or not set(shapes) <= set(SHAPES):
        ap.error(f"--shapes: a comma list of {', '.join(SHAPES)}")
    dtype = a.dtype or ("float32" if kind() == "cpu" else "bfloat16")
    t_start = time.perf_counter()
    busy = DeviceBusy(enable=not a.no_cupti)  # first: CUPTI traces from before any CUDA graph exists
    bw, bw_source, bw_measured = bandwidth()
    result: dict[str, Any] = {
        "benchmark": "decode_loops", "commit": commit(), "device": device(), "versions": versions(),
        "device_busy": "CUPTI kernel + memcpy + memset time, union per step" if busy.available() else busy.why,
        "bandwidth_bytes_per_s": bw, "bandwidth_source": bw_source, "bandwidth_measured_bytes_per_s": round(bw_measured),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "shapes": [],
    }

    def write() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")

    last = 0.0
    for name in shapes:
        t0 = time.perf_counter()
        loaded = load(name, a.layers or None, dtype)
        cfg = loaded.config
        label = name if not a.layers or name == "trained" or a.layers == PRESETS[SHAPES[name]]["num_hidden_layers"] \
            else f"{name} ({a.layers} of {PRESETS[SHAPES[name]]['num_hidden_layers']} layers)"
        shape: dict[str, Any] = {
            "shape": name, "label": label, "layers": cfg["num_hidden_layers"],
            "dtype": str(loaded.model.model.embed_tokens.weight.dtype), "random_weights": loaded.random_weights,
            "params": parameter_count(loaded.model), "build_s": round(time.perf_counter() - t0, 1), "rows": [],
            "skipped_batches": [],
        }
        result["shapes"].append(shape)
        print(f"decode_loops: {label} built in {shape['build_s']} s ({shape['params'] / 1e9:.2f} B parameters, "
              f"{shape['dtype']}), {result['device']}, commit {result['commit']}; device busy: {result['device_busy']}",
              flush=True)
        for B in [int(b) for b in a.batches.split(",") if b]:
            elapsed = time.perf_counter() - t_start
            if a.budget_s and elapsed + 1.3 * last > a.budget_s:
                shape["skipped_batches"].append(B)
                print(f"decode_loops: skip {name} batch {B} ({elapsed:.0f} s of {a.budget_s:.0f} s used)", flush=True)
                continue
            tb = time.perf_counter()
            row = loops_at(loaded, B, a, busy, bw)
            row["seconds"] = round(time.perf_counter() - tb, 1)
            last = row["seconds"]
            shape["rows"].append(row)
            write()
            print("decode_loops: " + json.dumps({"shape": name, **{k: row[k] for k in row if k != "bytes_per_step"}}),
                  flush=True)
        measured = moe_dispatch.plan_of(loaded.model)
        plans = {"measured": measured, "mlx-lm": moe_dispatch.MLX_LM} if measured is not None else {"-": None}
        if measured is not None:
            shape["moe_dispatch"] = {"measured": measured.describe(), "way_at": measured.way_at,
                                     "ways": measured.ways, "timings_ms_tokens_ways": measured.timings_ms}
            print(f"decode_loops: MoE dispatch measured at build: {measured.describe()}; (tokens, ms of "
                  f"{', '.join(measured.ways)}) over {moe_dispatch.TIMED_LAYERS} layers: {measured.timings_ms}",
                  flush=True)
        for B in [int(b) for b in a.mtp_batches.split(",") if b]:
            for policy in [d for d in a.dispatch.split(",") if d in plans] or list(plans)[:1]:
                elapsed = time.perf_counter() - t_start
                if a.budget_s and elapsed > a.budget_s:
                    shape["skipped_batches"].append(f"mtp{B}_{policy}")
                    continue
                if plans[policy] is not None:
                    moe_dispatch.set_plan(plans[policy], loaded.model, loaded.head)
                m = {"dispatch": policy, **mtp_against_plain(loaded, B, a, busy)}
                shape.setdefault("mtp", []).append(m)
                write()
                print("decode_loops: mtp " + json.dumps(m), flush=True)
        if measured is not None:
            moe_dispatch.set_plan(measured, loaded.model, loaded.head)
        del loaded
        gc.collect()
        mx.clear_cache()
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    write()
    print(table(result))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
