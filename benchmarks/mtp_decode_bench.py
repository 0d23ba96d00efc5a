#!/usr/bin/env python3
"""Batched MTP speculative decoding in the text engine: throughput with and without MTP.

For each batch size B (default 1, 2, 4, 8), B prompts are prefilled and then decoded greedily by
the continuous-batching scheduler with
  plain         plain decoding (``decode=None``), one token per row per step
  mtp           MTPDecode, per-row acceptance, k drafts, every row drafting every step
  mtp_batchwide MTPDecode with batch-wide all-or-nothing acceptance (the host's scheme)
  mtp_adaptive  MTPDecode choosing 0..k drafts per step by measured throughput, one instance
                across the warm-up and timed runs (as the server keeps it: what it learnt persists)
  mtp_adaptive_cold  the same, a fresh instance per run (learning included in the timing)
  plain_control plain again; speedups are against the mean of a round's two plain runs, and
                plain_control_ratio (one against the other) is the noise floor
reporting decode tokens/s (decode steps only, prefill excluded: the runner's ``decode`` and, with MTP, the
draft policy's ``plan`` and ``observe`` around it; see ``DecodeTimer``), speedup over plain, acceptance,
and whether every request's tokens equal the plain run's. Step costs at each B:
  t1  one plain decode step (1 token per row)
  t2  one verify forward (2 tokens per row, gated-delta states captured, rollback)
  tm  one MTP head step (the head over each row's new pairs + lm_head + draft)
and engine efficiency = measured speedup / ((1 + a) * t1 / (t2 + tm)) (1.0: the engine loses
nothing beyond the forward passes themselves). t2 is also timed without capture and with the
batch-1 reference's capture (every gated-delta layer run one token at a time), to show what the
in-recurrence capture costs.

Model: models/tiny-qwen35-trained (a trained MTP head: real acceptance) when present, else the
project's tiny random model with FORCED acceptance: a draft hook (``support.draft_hook``) proposes the
target's true next token with probability --forced-acceptance (stated in the JSON as acceptance_source).
Passing --forced-acceptance forces it for any model (e.g. the random-weight Qwen3.5-2B shape of
make_qwen35_2b.py, whose own head accepts nothing): the hook syncs the drafts to the host each
step, a cost the head's own drafts do not have, so forced runs understate MTP slightly.

  python benchmarks/mtp_decode_bench.py --out benchmarks/results/mtp_decode_cpu.json
  python benchmarks/mtp_decode_bench.py --quick            # a minute on CPU
Runs wherever MLX runs (CPU; NVIDIA GPUs through MLX's CUDA backend); no network.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test support package: support.*

import mlx.core as mx  # noqa: E402

from mlx_lm.models.base import create_attention_mask  # noqa: E402

from support.draft_hook import hooked_decode  # noqa: E402
from vllm_mlx_mtp_routing.model.backbone import backbone_forward, rollback_rows  # noqa: E402
from vllm_mlx_mtp_routing.model.mtp import lm_head  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.batch_cache import RaggedKVCache  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.row import Row  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.runner import ModelRunner  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.sampling import RowSampler, SamplingOptions  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.state import TextRequest  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.step_plan import PrefillChunk  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import provenance  # noqa: E402
from lib.shapes import time_steps  # noqa: E402

TRAINED = ROOT / "models" / "tiny-qwen35-trained"
COUNTERS = ("drafted", "accepted", "steps_with_mtp", "steps_without_mtp")


def load_bundle(path: Path | None):
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    source = "trained MTP head (real acceptance)"
    if path is None and TRAINED.exists():
        path = TRAINED
    if path is None:
        from support.tiny_model import tiny_model_dir

        path = tiny_model_dir(Path(tempfile.mkdtemp()), dtype="float32", placement="subdir")
        source = "random tiny model, FORCED acceptance"
    vlm, processor = load(str(path))
    bundle = build_text_model(vlm, path, json.loads((path / "config.json").read_text()))
    if bundle.mtp is None:
        raise SystemExit(f"{path} has no MTP head: {bundle.mtp_unavailable_reason}")
    return path, bundle, processor.tokenizer, source


def gpu_name() -> str | None:
    """The NVIDIA GPU's name when MLX runs on one (MLX reports only "gpu")."""
    if mx.default_device() != mx.gpu:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=False).stdout.strip()
    except OSError:
        return None
    return out.splitlines()[0] if out else None


def make_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """Held-out-style stdlib source (the trained model's domain), length tokens each."""
    std = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(std.glob("*.py"), key=lambda f: hashlib.sha1(f.name.encode()).hexdigest())
    prompts = []
    for f in files:
        ids = tokenizer.encode(f.read_text(errors="ignore")[: 20 * length])
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            return prompts
    raise SystemExit("not enough stdlib source for prompts")


class Oracle:
    """Draft hook: the true next token with probability a, else a wrong one (forced acceptance)."""

    def __init__(self, prompts, continuations, a: float, vocab: int, seed: int = 0):
        self.full = [p + c for p, c in zip(prompts, continuations)]
        self.plen = [len(p) for p in prompts]
        self.a, self.vocab, self.rng = a, vocab, random.Random(seed)

    def __call__(self, histories, drafts):
        out = []
        for h, d in zip(histories, drafts):
            if d is None:
                out.append(None)
                continue
            full = next(f for f, n in zip(self.full, self.plen) if f[:n] == h[:n])
            truth = full[len(h) : len(h) + len(d)] + [0] * len(d)
            out.append([t if self.rng.random() < self.a else (t + 1) % self.vocab for t in truth[: len(d)]])
        return out


class DecodeTimer:
    """A scheduler's decode steps, timed through its public parts: the runner's ``decode``, ``decode_ahead`` and
    ``settle`` (the step's model work:
    forward, sampling, with MTP the drafts, verify, acceptance and rollback) and, with MTP, the decode's ``plan`` and
    ``observe`` around it (the draft policy's decision and bookkeeping). Wrapped on the instances while the timer is
    open (``with DecodeTimer(sched) as timer:``); the scheduler's own bookkeeping (stops, detokenizing, joins,
    prefill) is not counted.

    ``seconds``: the steps' time; ``tokens``: tokens the steps emitted; ``steps``; ``end``: when the last step's work
    ended (``time.perf_counter``)."""

    def __init__(self, sched: BatchScheduler) -> None:
        self.runner, self.spec = sched.runner, sched.spec
        self.seconds, self.tokens, self.steps, self.end = 0.0, 0, 0, None

    def __enter__(self) -> DecodeTimer:
        # A serial step returns its result; a step launched ahead returns the (rows, result) of the one before, or None.
        self.runner.decode = self.wrap(self.runner.decode, lambda result: result)
        for name in ("decode_ahead", "settle"):
            setattr(self.runner, name, self.wrap(getattr(self.runner, name), lambda done: done[1] if done else None))
        if self.spec is not None:
            for name in ("plan", "observe"):
                setattr(self.spec, name, self.wrap(getattr(self.spec, name)))
        return self

    def wrap(self, fn, result_of=None):
        """``fn`` timed; with ``result_of`` (its return value -> a DecodeResult or None) its tokens and steps counted."""
        def timed(*args, **kwargs):
            tic = time.perf_counter()
            out = fn(*args, **kwargs)
            self.end = time.perf_counter()
            self.seconds += self.end - tic
            result = result_of(out) if result_of is not None else None
            if result is not None:
                self.tokens += sum(len(t) for t in result.tokens)
                self.steps += 1
            return out
        return timed

    def __exit__(self, *exc) -> None:
        del self.runner.decode, self.runner.decode_ahead, self.runner.settle  # the class's methods again
        if self.spec is not None:
            del self.spec.plan, self.spec.observe


def run(bundle, tok, prompts, max_tokens, decode):
    """Greedy outputs of the prompts decoded in one batch (``decode``: None for plain decoding, else an
    ``MTPDecode``) -> (tokens per prompt, the ``DecodeTimer`` of the run)."""
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=len(prompts), prefill_step_size=4096,
                           eos_token_ids=[], decode=decode)
    for i, p in enumerate(prompts):
        sched.add(TextRequest(str(i), p, SamplingOptions(max_tokens=max_tokens)))
    finals = {}
    with DecodeTimer(sched) as timer:
        while sched.has_work():
            for o in sched.step():
                if o.finished:
                    finals[int(o.request_id)] = o.token_ids
    return [finals[i] for i in range(len(prompts))], timer


def median_ms(fn, iters: int) -> float:
    return statistics.median(time_steps(fn, warmup=1, iters=iters))


def _snapshot(layers) -> list:
    return [c.checkpoint() if isinstance(c, RaggedKVCache) else list(c.cache) for c in layers]


def _restore(layers, snap) -> None:
    for c, s in zip(layers, snap):
        if isinstance(c, RaggedKVCache):
            c.restore(s)
        else:
            c.cache = list(s)


def joined(model, decode: MTPDecode, tok, prompts, states=None) -> ModelRunner:
    """A model runner whose decode batch holds the prompts as joined rows, each prefilled by the runner (or restored
    from ``states(i)``, a ``PrefillState`` covering ``prompt[:-1]``) as the scheduler would."""
    runner = ModelRunner(model, decode)
    for i, p in enumerate(prompts):
        row = Row(TextRequest(str(i), p), tok, set(), states(i) if states is not None else None)
        if row.prefilled < row.to_prefill:
            (done,) = runner.prefill([PrefillChunk(row, row.prefilled, row.to_prefill)])
            if done.error is not None:
                raise done.error
        runner.join(row)
    return runner


def step_costs(bundle, prompts, k: int, iters: int, tok=None) -> dict:
    """t1, t2 (three capture variants), tm at this batch size, over prefilled caches rewound
    after every timed step (the context length stays fixed)."""
    model, head = bundle.model, bundle.mtp
    B = len(prompts)
    x = mx.array([p[-1] for p in prompts], dtype=mx.uint32)[:, None]
    feed = mx.concatenate([x, x], axis=1)
    mtp = MTPDecode(head, k=k, adaptive=False)
    batch = joined(model, mtp, tok, prompts).batch
    cache = batch.backbone
    snap = _snapshot(cache.layers)
    keep = [1 + (i % 2) for i in range(B)]  # half the rows accept, half reject

    def timed(fn):
        def go():
            fn()
            _restore(cache.layers, snap)
        return median_ms(go, iters)

    def t1():
        logits = model(x, cache=cache.layers)[:, -1, :]
        mx.eval(mx.argmax(logits, axis=-1), cache.state())

    def t2(capture: bool):
        def fn():
            logits, _, captured = backbone_forward(model, feed, cache.layers, capture=capture)
            mx.eval(mx.argmax(logits, axis=-1))
            if captured:
                rollback_rows(cache.layers, captured, keep, 2)
            mx.eval(cache.state())
        return fn

    def t2_layer_loop():  # the batch-1 reference's capture: each gated-delta layer token by token
        inner = model.model
        h = inner.embed_tokens(feed)
        mask = create_attention_mask(h, cache.layers[inner.fa_idx])
        states = []
        for layer, c in zip(inner.layers, cache.layers):
            if layer.is_linear:
                outs = []
                for i in range(feed.shape[1]):
                    outs.append(layer(h[:, i : i + 1], cache=c))
                    states.append(list(c.state))
                h = mx.concatenate(outs, axis=1)
            else:
                h = layer(h, mask=mask, cache=c)
        mx.eval(mx.argmax(lm_head(model, inner.norm(h)), axis=-1), states)

    res = {
        "t1_ms": timed(t1),
        "t2_ms": timed(t2(True)),
        "t2_nocapture_ms": timed(t2(False)),
        "t2_layer_loop_capture_ms": timed(t2_layer_loop),
    }

    greedy = [RowSampler(SamplingOptions(max_tokens=10**6)) for _ in range(B)]
    states = [r.spec for r in batch.rows]  # each row's MTPRowState
    h_new = mx.zeros((B, 1, model.args.hidden_size), states[0].pending_h[0][0].dtype)
    msnap = _snapshot(batch.head)

    def tm():  # one new verified pair per row, as after an all-rejected step, then k drafts
        for i, r in enumerate(states):
            r.pending_h, r.pending_t, r.skipped = [], [], 0
            r.add_pending(h_new, i, [int(x[i, 0].item())])
        proposal = mtp.proposer.propose(k, states, batch.head, [True] * B, greedy)
        mx.eval(proposal.drafts, [c.state for c in batch.head])
        _restore(batch.head, msnap)

    res["tm_ms"] = median_ms(tm, iters)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--extra-k", default="2,3", help="also measure per-row MTP with these k")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--forced-acceptance", type=float, default=None,
                    help="force this acceptance with a draft hook (default: 0.7 on the random tiny model only)")
    ap.add_argument("--repeats", type=int, default=4, help="timed rounds after the warm-up round")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--configs", default=None,
                    help="comma-separated configurations to run beside plain and plain_control (default: all)")
    ap.add_argument("--quick", action="store_true", help="batches 1,4; 32 tokens; one repeat")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.quick:
        a.batches, a.max_tokens, a.repeats, a.iters, a.extra_k = "1,4", 32, 1, 8, "2"
    batches = [int(b) for b in a.batches.split(",")]
    extra_k = [int(k) for k in a.extra_k.split(",") if k]

    path, bundle, tok, source = load_bundle(a.model)
    prompts_all = make_prompts(tok, max(batches), a.prompt_tokens)
    forced = "FORCED" in source or a.forced_acceptance is not None
    if a.forced_acceptance is None:
        a.forced_acceptance = 0.7
    if forced and "FORCED" not in source:
        source = "random weights, FORCED acceptance"
    hook = None
    if forced:
        conts, _ = run(bundle, tok, prompts_all, a.max_tokens + max([a.k, *extra_k]) + 1, None)
        hook = Oracle(prompts_all, conts, a.forced_acceptance, bundle.model.args.vocab_size)
        source += f" (the true next token proposed with probability {a.forced_acceptance})"

    def stats_delta(decode, before) -> dict:
        after = decode.stats() if decode is not None else {}
        return {**after, **{key: after[key] - before.get(key, 0) for key in COUNTERS if key in after}}

    rows: list[dict] = []

    def write_result() -> dict:
        """The result so far (rewritten after every batch size: a cut run keeps what it measured)."""
        result = {
            "benchmark": "mtp_decode_bench",
            "model": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name),
            "acceptance_source": source,
            "dtype": str(bundle.model.model.embed_tokens.weight.dtype),
            "device": str(mx.default_device()),
            "gpu": gpu_name(),
            "mlx": mx.__version__,
            **provenance.record(),
            "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cpus, Python {platform.python_version()}",
            "k": a.k,
            "prompt_tokens": a.prompt_tokens,
            "max_tokens": a.max_tokens,
            "quick": a.quick,
            "greedy": True,
            "rows": rows,
        }
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
        return result

    def mtp(k: int, **options) -> MTPDecode:
        """The engine's MTP decoding, its drafts through the forcing hook where acceptance is forced."""
        if hook is not None:
            return hooked_decode(bundle.mtp, hook, k=k, **options)
        return MTPDecode(bundle.mtp, k, **options)

    def plain_decode() -> None:
        return None  # plain decoding: the scheduler's decode=None

    for B in batches:
        prompts = prompts_all[:B]
        adaptive = lambda: mtp(a.k, adaptive=True)  # noqa: E731
        # name -> (factory, reuse): a reused decode serves every round, as the server's does
        # (what its adaptive policy learnt persists); the others start fresh each run.
        configs = {
            "plain": (plain_decode, False),
            "mtp": (lambda: mtp(a.k, adaptive=False), False),
            "mtp_batchwide": (lambda: mtp(a.k, adaptive=False, per_row_acceptance=False), False),
            "mtp_adaptive": (adaptive, True),
            "mtp_adaptive_cold": (adaptive, False),
        }
        if a.configs:
            configs = {n: c for n, c in configs.items() if n in ("plain", *a.configs.split(","))}
        for k in extra_k:
            configs[f"mtp_k{k}"] = (lambda k=k: mtp(k, adaptive=False), False)
        # Plain again at the end of each round: its "speedup" is the noise floor of the others.
        configs["plain_control"] = (plain_decode, False)
        kept = {name: None for name in configs}
        runs: dict[str, list[tuple[float, list, dict]]] = {name: [] for name in configs}
        # Rounds interleave the configurations, each round in a rotated order, and every speedup is
        # taken against the mean of the same round's two plain runs: a run's position in a round
        # moves its speed by a few percent on the 2-core CPU. The first round is a warm-up (every
        # shape compiled, the reused schedules trained).
        names = list(configs)
        for rnd in range(a.repeats + 1):
            for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                make, reuse = configs[name]
                decode = kept[name] if reuse and kept[name] is not None else make()
                kept[name] = decode
                before = decode.stats() if decode is not None else {}
                # Every run starts from an empty buffer cache and no garbage: otherwise a run reuses
                # (or pages in) buffers shaped by the configuration before it in the round.
                gc.collect()
                mx.clear_cache()
                tokens, timed = run(bundle, tok, prompts, a.max_tokens, decode)
                if rnd:
                    runs[name].append((timed.tokens / timed.seconds, tokens, stats_delta(decode, before)))
        plain = [(p[0] + c[0]) / 2 for p, c in zip(runs["plain"], runs["plain_control"])]
        ref = runs["plain"][0][1]
        row = {
            "batch": B,
            "plain_tok_s": round(statistics.median(plain), 1),
            # the two plain runs of a round against each other: the noise floor of every speedup
            "plain_control_ratio": round(statistics.median(c[0] / p[0] for p, c in zip(runs["plain"],
                                                                                        runs["plain_control"])), 3),
        }
        for name in names:
            if name in ("plain", "plain_control"):
                continue
            tps = [r[0] for r in runs[name]]
            s = {key: sum(r[2].get(key, 0) for r in runs[name]) for key in COUNTERS}
            s["k"] = runs[name][0][2]["k"]
            drafting_steps = s["drafted"] / s["k"]
            row[name] = {
                "tok_s": round(statistics.median(tps), 1),
                # the median of same-round ratios: each against the plain runs of its round
                "speedup": round(statistics.median(t / p for t, p in zip(tps, plain)), 3),
                "speedup_per_round": [round(t / p, 3) for t, p in zip(tps, plain)],
                "acceptance": round(s["accepted"] / s["drafted"], 3) if s["drafted"] else 0.0,
                "tokens_per_row_step": round((s["accepted"] + drafting_steps) / max(drafting_steps, 1), 3)
                if s["drafted"] else 1.0,
                "steps_with_mtp": s["steps_with_mtp"],
                "steps_without_mtp": s["steps_without_mtp"],
                "exact": all(r[1] == ref for r in runs[name]),
            }
        costs = step_costs(bundle, prompts, a.k, a.iters, tok)
        row.update({key: round(v, 3) for key, v in costs.items()})
        acc = row["mtp"]["acceptance"]
        ideal = (1 + acc) * costs["t1_ms"] / (costs["t2_ms"] + costs["tm_ms"])
        row["ideal_speedup"] = round(ideal, 3)
        row["engine_efficiency"] = round(row["mtp"]["speedup"] / ideal, 3)
        row["t2_over_t1"] = round(costs["t2_ms"] / costs["t1_ms"], 3)
        row["t2_layer_loop_over_t1"] = round(costs["t2_layer_loop_capture_ms"] / costs["t1_ms"], 3)
        rows.append(row)
        write_result()
        print(json.dumps(row), flush=True)

    print(json.dumps(write_result(), indent=1))


if __name__ == "__main__":
    main()
