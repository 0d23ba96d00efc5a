#!/usr/bin/env python3
"""Batched MTP speculative decoding in the text engine: throughput with and without MTP.

For each batch size B (default 1, 2, 4, 8), B prompts are prefilled and then decoded greedily by
the continuous-batching scheduler with
  plain         SingleTokenDecode, one token per row per step
  mtp           MTPDecode, per-row acceptance, k drafts, every row drafting every step
  mtp_batchwide MTPDecode with batch-wide all-or-nothing acceptance (the host's scheme)
  mtp_adaptive  MTPDecode choosing 0..k drafts per step by measured throughput
reporting decode tokens/s (decode steps only, prefill excluded), speedup over plain, acceptance,
and whether every request's tokens equal the plain run's. Step costs at each B:
  t1  one plain decode step (1 token per row)
  t2  one verify forward (2 tokens per row, gated-delta states captured, rollback)
  tm  one MTP head step (the head over each row's new pairs + lm_head + draft)
and engine efficiency = measured speedup / ((1 + a) * t1 / (t2 + tm)) (1.0: the engine loses
nothing beyond the forward passes themselves). t2 is also timed without capture and with the
batch-1 reference's capture (every gated-delta layer run one token at a time), to show what the
in-recurrence capture costs.

Model: models/tiny-qwen35-trained (a trained MTP head: real acceptance) when present, else the
project's tiny random model with FORCED acceptance: a draft hook proposes the target's true next
token with probability --forced-acceptance (stated in the JSON as acceptance_source).

  python benchmarks/mtp_decode_bench.py --out benchmarks/results/mtp_decode_cpu.json
  python benchmarks/mtp_decode_bench.py --quick            # a minute on CPU
Runs wherever MLX runs (CPU; NVIDIA GPUs through MLX's CUDA backend); no network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from mlx_lm.models.base import create_attention_mask  # noqa: E402

from vllm_mlx_mtp_routing.mtp import lm_head  # noqa: E402
from vllm_mlx_mtp_routing.text_engine import (  # noqa: E402
    BatchCache,
    BatchScheduler,
    RaggedKVCache,
    SamplingOptions,
    TextRequest,
)
from vllm_mlx_mtp_routing.text_engine.decode import SingleTokenDecode  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.mtp_decode import MTPDecode, backbone_forward, rollback_rows  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.sampling import RowSampler  # noqa: E402

TRAINED = ROOT / "models" / "tiny-qwen35-trained"


def load_bundle(path: Path | None):
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.text_model import build_text_model

    source = "trained MTP head (real acceptance)"
    if path is None and TRAINED.exists():
        path = TRAINED
    if path is None:
        from vllm_mlx_mtp_routing.testing.tiny_model import tiny_model_dir

        path = tiny_model_dir(Path(tempfile.mkdtemp()), dtype="float32", placement="subdir")
        source = "random tiny model, FORCED acceptance"
    vlm, processor = load(str(path))
    bundle = build_text_model(vlm, path, json.loads((path / "config.json").read_text()))
    if bundle.mtp is None:
        raise SystemExit(f"{path} has no MTP head: {bundle.mtp_unavailable_reason}")
    return path, bundle, processor.tokenizer, source


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


class Timed:
    """Wraps a strategy: decode-step seconds and emitted tokens."""

    def __init__(self, inner):
        self.inner, self.seconds, self.tokens = inner, 0.0, 0

    def prefill(self, *a):
        return self.inner.prefill(*a)

    def join(self, *a):
        return self.inner.join(*a)

    def leave(self, keep):
        return self.inner.leave(keep)

    def step(self, *a):
        t = time.perf_counter()
        res = self.inner.step(*a)
        self.seconds += time.perf_counter() - t
        self.tokens += sum(len(x) for x in res.tokens)
        return res


def run(bundle, tok, prompts, max_tokens, decode):
    timed = Timed(decode)
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=len(prompts), prefill_step_size=4096,
                           eos_token_ids=[], decode=timed)
    for i, p in enumerate(prompts):
        sched.add(TextRequest(str(i), p, SamplingOptions(max_tokens=max_tokens)))
    finals = {}
    while sched.has_work():
        for o in sched.step():
            if o.finished:
                finals[int(o.request_id)] = o.token_ids
    return [finals[i] for i in range(len(prompts))], timed


def median_ms(fn, iters: int) -> float:
    fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - t))
    return statistics.median(out)


def _snapshot(layers) -> list:
    return [(c.keys, c.values, c.lengths) if isinstance(c, RaggedKVCache) else list(c.cache) for c in layers]


def _restore(layers, snap) -> None:
    for c, s in zip(layers, snap):
        if isinstance(c, RaggedKVCache):
            c.keys, c.values = s[0], s[1]
            c._set_lengths(s[2])  # RaggedKVCache internals: the bench rewinds the cache
        else:
            c.cache = list(s)


def step_costs(bundle, prompts, k: int, iters: int) -> dict:
    """t1, t2 (three capture variants), tm at this batch size, over prefilled caches rewound
    after every timed step (the context length stays fixed)."""
    model, head = bundle.model, bundle.mtp
    B = len(prompts)
    x = mx.array([p[-1] for p in prompts], dtype=mx.uint32)[:, None]
    feed = mx.concatenate([x, x], axis=1)
    mtp = MTPDecode(head, k=k, adaptive=False)
    cache = BatchCache(model)
    for p in prompts:
        row, c = {}, model.make_cache()
        mtp.prefill(model, mx.array([p[:-1]], dtype=mx.uint32), c, row)
        mtp.join(c, p, row)
        cache.add_row(c)
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
                rollback_rows(cache, captured, keep, 2)
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
    h_new = mx.zeros((B, 1, model.args.hidden_size), mtp._rows[0].pending_h[0][0].dtype)
    msnap = _snapshot(mtp._cache)

    def tm():  # one new verified pair per row, as after an all-rejected step, then k drafts
        for i, r in enumerate(mtp._rows):
            r.pending_h, r.pending_t = [(h_new, i, 1)], [int(x[i, 0].item())]
        drafts, _ = mtp._draft(k, [True] * B, greedy)
        mx.eval(drafts, [c.state for c in mtp._cache])
        _restore(mtp._cache, msnap)

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
    ap.add_argument("--forced-acceptance", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="batches 1,4; 32 tokens; one repeat")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.quick:
        a.batches, a.max_tokens, a.repeats, a.iters, a.extra_k = "1,4", 32, 1, 8, "2"
    batches = [int(b) for b in a.batches.split(",")]
    extra_k = [int(k) for k in a.extra_k.split(",") if k]

    path, bundle, tok, source = load_bundle(a.model)
    prompts_all = make_prompts(tok, max(batches), a.prompt_tokens)
    forced = "FORCED" in source
    hook = None
    if forced:
        conts, _ = run(bundle, tok, prompts_all, a.max_tokens + max([a.k, *extra_k]) + 1, SingleTokenDecode())
        hook = Oracle(prompts_all, conts, a.forced_acceptance, bundle.model.args.vocab_size)
        source += f" (the true next token proposed with probability {a.forced_acceptance})"

    def best_of(make):
        """Fastest of --repeats runs (after one warm-up run on the same shapes)."""
        best = None
        for _ in range(a.repeats + 1):
            decode = make()
            tokens, timed = run(bundle, tok, prompts, a.max_tokens, decode)
            tps = timed.tokens / timed.seconds
            if best is None or tps > best[0]:
                best = (tps, tokens, decode)
        return best

    rows = []
    for B in batches:
        prompts = prompts_all[:B]
        plain_tps, ref, _ = best_of(SingleTokenDecode)
        row = {"batch": B, "plain_tok_s": round(plain_tps, 1)}
        configs = {
            "mtp": lambda: MTPDecode(bundle.mtp, k=a.k, adaptive=False, draft_hook=hook),
            "mtp_batchwide": lambda: MTPDecode(bundle.mtp, k=a.k, adaptive=False, per_row_acceptance=False,
                                               draft_hook=hook),
            "mtp_adaptive": lambda: MTPDecode(bundle.mtp, k=a.k, adaptive=True, draft_hook=hook),
        }
        for k in extra_k:
            configs[f"mtp_k{k}"] = lambda k=k: MTPDecode(bundle.mtp, k=k, adaptive=False, draft_hook=hook)
        for name, make in configs.items():
            tps, tokens, decode = best_of(make)
            s = decode.stats()
            row[name] = {
                "tok_s": round(tps, 1),
                "speedup": round(tps / plain_tps, 3),
                "acceptance": round(s["acceptance_rate"], 3),
                "tokens_per_row_step": round((s["accepted"] + s["drafted"] / s["k"]) / max(s["drafted"] / s["k"], 1), 3)
                if s["drafted"] else 1.0,
                "steps_with_mtp": s["steps_with_mtp"],
                "steps_without_mtp": s["steps_without_mtp"],
                "exact": tokens == ref,
            }
        costs = step_costs(bundle, prompts, a.k, a.iters)
        row.update({key: round(v, 3) for key, v in costs.items()})
        acc = row["mtp"]["acceptance"]
        ideal = (1 + acc) * costs["t1_ms"] / (costs["t2_ms"] + costs["tm_ms"])
        row["ideal_speedup"] = round(ideal, 3)
        row["engine_efficiency"] = round(row["mtp"]["speedup"] / ideal, 3)
        row["t2_over_t1"] = round(costs["t2_ms"] / costs["t1_ms"], 3)
        row["t2_layer_loop_over_t1"] = round(costs["t2_layer_loop_capture_ms"] / costs["t1_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = {
        "benchmark": "mtp_decode_bench",
        "model": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name),
        "acceptance_source": source,
        "dtype": str(bundle.model.model.embed_tokens.weight.dtype),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cpus, Python {platform.python_version()}",
        "k": a.k,
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "quick": a.quick,
        "greedy": True,
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
