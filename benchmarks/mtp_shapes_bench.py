#!/usr/bin/env python3
"""MTP decoding in the text engine at realistic model shapes, with acceptance as a controlled input.

Builds a Qwen3.5-shaped text model and one-layer MTP head in memory with random weights in bf16,
drawn on the default device (nothing is written to disk), and drives the engine's own decode loop
(``BatchScheduler``, ``MTPDecode``: the head drafts, the backbone verifies, per-row acceptance,
per-row rollback) with ``support.forced_acceptance.ForcedAcceptanceDecode``: the verify agrees with
each draft with probability a. (A random model's head drafts nothing the backbone agrees with, and
an oracle proposing a plain run's continuation stops matching in bf16 on CUDA, where a [B, 2]
verify and a [B, 1] step round near-tie logits differently; forcing the verify's verdict avoids
both.) Per batch size B and acceptance a, in one process:

  plain          the engine's plain decoding, ``decode=None`` (twice a round: plain_control is the noise floor)
  mtp_a<a>       per-row acceptance, k = 1, every row drafting every step
  aon_a<a>       batch-wide all-or-nothing acceptance (the host's and mlx-vlm's scheme), B > 1
  t1 / t2 / tm   one plain step, one [B, 2] verify with capture + rollback, one head draft step
                 (t1 and t2 per gated-delta recurrence variant, VARIANTS: before/after in one run)
  ideal          (1 + a) * t1 / (t2 + tm) with a as measured; efficiency = speedup / ideal
  breakdown      where t2 - t1 sits: the gated-delta layers, the attention layers and the lm_head
                 run alone at 1 and 2 tokens per row (each group timed as one graph)

and, for a long prompt (--prefill-tokens), its prefill (``runner.prefill_forward``) without MTP, with MTP
(the head over the prompt's last positions, the default) and with the head over every position (the
former way), at the chunk size the server would pick (``prefill_budget.calibrate``): MTP's prefill tax,
against the head's share of the model's parameters.

Decode tok/s counts the decode steps only (``mtp_decode_bench.DecodeTimer``: the runner's ``decode``
and, with MTP, the draft policy's ``plan`` and ``observe``); t1 / t2 / tm run on the batch caches of a
``ModelRunner`` whose rows joined as the scheduler joins them, tm through the proposer
(``MTPProposer.propose``).

Prompts are random token ids of the trained tiny model's tokenizer (the engine detokenizes every
step), prefilled once per shape as one batch and restored into every run (``BatchScheduler.add(...,
restored=...)``), so the runs time decoding only. lm_head rows of ids the tokenizer lacks, and of
its special tokens, are zero: no run stops early.

  python benchmarks/mtp_shapes_bench.py --shape 2b --out mtp_shapes_2b.json     # a GPU
  python benchmarks/mtp_shapes_bench.py --smoke --out /tmp/smoke.json             # CPU, tiny shape
Every result file records the commit (BENCH_COMMIT or git), the device and the package versions;
it is rewritten after every batch size, so a run cut by --budget-s or a kill keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test support package: support.*
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from lib.provenance import commit, device, versions  # noqa: E402
from lib import random_model  # noqa: E402
from lib.random_model import parameter_count, text_config  # noqa: E402
from lib.shapes import PRESETS  # noqa: E402
from vllm_mlx_mtp_routing.model import backbone  # noqa: E402
from vllm_mlx_mtp_routing.model.backbone import (  # noqa: E402
    FusedGatedDeltaNet,
    backbone_forward,
    gated_delta_layer,
    lm_head,
    rollback_rows,
)
from vllm_mlx_mtp_routing.model.mlx_lm_internals import (  # noqa: E402
    ArraysCache,
    GatedDeltaNet,
    KVCache,
    TextModel,
    create_attention_mask,
)
from vllm_mlx_mtp_routing.model.mtp import MTPHead  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels.device import on_cuda  # noqa: E402
from support.forced_acceptance import ForcedAcceptanceDecode  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.batch_cache import RaggedKVCache  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.prefill_budget import calibrate  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.runner import prefill_forward  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.sampling import RowSampler, SamplingOptions  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.spec.proposer import MTPProposer  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.state import PrefillState, TextRequest  # noqa: E402
from mtp_decode_bench import DecodeTimer, joined  # noqa: E402

TRAINED = ROOT / "models" / "tiny-qwen35-trained"
# The gated-delta recurrence, plain step and verify alike: "loop" is mlx-lm's per-token loop (the
# text path before the fused kernel), "fused" the CUDA kernel the text model runs now (mlx-lm's loop
# off CUDA), "compiled" / "compiled_layer" the verify's recurrence / whole layer compiled (the plain
# step as "fused"). DEFAULT is what the engine runs: the speedups are measured with it.
VARIANTS = ("loop", "fused", "compiled", "compiled_layer")
DEFAULT = "fused"


@contextlib.contextmanager
def variant(model: TextModel, name: str) -> Iterator[None]:
    """Run the model's plain steps and its verify with this recurrence variant, then restore."""
    plain = GatedDeltaNet if name == "loop" else FusedGatedDeltaNet
    lins = [layer.linear_attn for layer in model.model.layers if layer.is_linear]
    classes = [type(lin) for lin in lins]
    before = backbone.use_recurrence(name)
    try:
        for lin in lins:
            if on_cuda() or plain is GatedDeltaNet:
                lin.__class__ = plain
        yield
    finally:
        backbone.use_recurrence(before)
        for lin, cls in zip(lins, classes):
            lin.__class__ = cls

SHAPES = {"2b": PRESETS["qwen35-2b"], "9b": PRESETS["qwen35-9b"], "small": PRESETS["tiny"]}


# -- the model ----------------------------------------------------------------------------------


def build(shape: dict, dtype: Any, zero_ids: list[int], seed: int = 0) -> tuple[TextModel, MTPHead, int, int]:
    """(TextModel, bound MTPHead, backbone parameters, head parameters) with random weights and the engine's class
    swaps (lib/random_model.py)."""
    model, head = random_model.build(text_config(shape), dtype, zero_ids, seed)
    return model, head, parameter_count(model), parameter_count(head)


def load_tokenizer():
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(TRAINED)
    size = len(tok.get_vocab())  # with the added tokens
    special = set(tok.all_special_ids) | set(tok.eos_token_ids)
    return tok, size, sorted(special)


# -- prefilled rows, restored into every run ----------------------------------------------------


class Rows:
    """Prompts prefilled once as one batch (backbone and head), handed to each run as fresh
    single-sequence ``PrefillState``s (the arrays are only read by a join)."""

    def __init__(self, model: TextModel, head: MTPHead, prompts: list[list[int]]) -> None:
        self.prompts = prompts
        tokens = mx.array([p[:-1] for p in prompts], dtype=mx.uint32)
        cache = model.make_cache()
        _, hidden, _ = backbone_forward(model, tokens, cache, logits=False)
        mcache = head.make_cache()
        # The head's pairs (h_t, token_t+1), t < n - 1, as MTPProposer.prefill builds them.
        head.forward(hidden, mx.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1), mcache)
        for c in mcache:
            c.trim(1)
        mx.eval([c.state for c in cache], [c.state for c in mcache], hidden)
        self.backbone = [self._split(c) for c in cache]
        self.head = [self._split(c) for c in mcache]
        self.hidden = [hidden[i : i + 1, -1:] for i in range(len(prompts))]
        mx.eval(self.backbone, self.head, self.hidden)

    @staticmethod
    def _split(c: Any) -> list:
        B = c.state[0].shape[0]
        if isinstance(c, KVCache):
            return [(c.keys[i : i + 1, :, : c.offset], c.values[i : i + 1, :, : c.offset], c.offset) for i in range(B)]
        return [[a[i : i + 1] for a in c.cache] for i in range(B)]

    def state(self, i: int) -> PrefillState:
        layers = []
        for per_row in self.backbone:
            saved = per_row[i]
            if isinstance(saved, tuple):
                c = KVCache()
                c.keys, c.values, c.offset = saved
            else:
                c = ArraysCache(size=len(saved))
                c.cache = list(saved)
            layers.append(c)
        head = []
        for per_row in self.head:
            c = KVCache()
            c.keys, c.values, c.offset = per_row[i]
            head.append(c)
        return PrefillState(backbone=layers, head=head, head_hidden=self.hidden[i], prefilled=len(self.prompts[i]) - 1)


def decode_run(model: TextModel, tok: Any, rows: Rows, B: int, max_tokens: int,
               decode: MTPDecode | None) -> DecodeTimer:
    """B restored rows decoded to ``max_tokens`` (``decode``: None for plain decoding) -> the run's decode timer."""
    sched = BatchScheduler(model, tok, max_num_seqs=B, prefill_step_size=4096, eos_token_ids=[], decode=decode)
    for i in range(B):
        sched.add(TextRequest(str(i), rows.prompts[i], SamplingOptions(max_tokens=max_tokens)), restored=rows.state(i))
    with DecodeTimer(sched) as timer:
        while sched.has_work():
            sched.step()
    return timer


# -- step costs -----------------------------------------------------------------------------------


def median_ms(fn: Callable[[], None], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def _snapshot(layers: list) -> list:
    return [c.checkpoint() if isinstance(c, RaggedKVCache) else list(c.cache) for c in layers]


def _restore(layers: list, snap: list) -> None:
    for c, s in zip(layers, snap):
        if isinstance(c, RaggedKVCache):
            c.restore(s)
        else:
            c.cache = list(s)


def step_costs(model: TextModel, head: MTPHead, tok: Any, rows: Rows, B: int, iters: int) -> dict:
    """t1, t2 per recurrence, t2 without capture, tm, and the t1 / t2 breakdown by layer kind, on
    the engine's batch caches, rewound after every timed step (the context stays fixed)."""
    mtp = MTPDecode(head, k=1, adaptive=False)
    batch = joined(model, mtp, tok, rows.prompts[:B], rows.state).batch
    cache = batch.backbone
    snap = _snapshot(cache.layers)
    x = mx.array([p[-1] for p in rows.prompts[:B]], dtype=mx.uint32)[:, None]
    feed = mx.concatenate([x, (x + 1) % 1000], axis=1)
    keep = [1 + (i % 2) for i in range(B)]  # half the rows accept, half reject

    def rewound(fn: Callable[[], None]) -> float:
        def go() -> None:
            fn()
            _restore(cache.layers, snap)
        return median_ms(go, iters)

    def t1() -> None:
        logits = model(x, cache=cache.layers)[:, -1, :]
        mx.eval(mx.argmax(logits, axis=-1), cache.state())

    def t2(capture: bool) -> Callable[[], None]:
        def fn() -> None:
            logits, _, captured = backbone_forward(model, feed, cache.layers, capture=capture)
            mx.eval(mx.argmax(logits, axis=-1))
            if captured:
                rollback_rows(cache.layers, captured, keep, 2)
            mx.eval(cache.state())
        return fn

    res: dict[str, Any] = {}
    for name in VARIANTS:
        try:
            with variant(model, name):
                res[f"t1_{name}_ms"] = rewound(t1)
                res[f"t2_{name}_ms"] = rewound(t2(True))
        except Exception as e:  # noqa: BLE001 - a variant that fails on this device is recorded, not fatal
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            _restore(cache.layers, snap)
    res["t1_ms"], res["t2_ms"] = res[f"t1_{DEFAULT}_ms"], res[f"t2_{DEFAULT}_ms"]
    res["t2_nocapture_ms"] = rewound(t2(False))
    # The medians above are taken one after the other, so a slow phase of a shared GPU host can land on
    # one of them (t1 moved 7-11 ms across variants in one run). Here t1, t2 and t2 without capture
    # alternate within each iteration and the ratio is taken per iteration: the phase falls on both.
    ratios: dict[str, list[float]] = {"t2": [], "t2_nocapture": [], "capture_rollback_ms": []}
    with variant(model, DEFAULT):
        for fn in (t1, t2(True), t2(False)):  # warm
            fn()
            _restore(cache.layers, snap)
        for _ in range(3 * iters):
            costs = []
            for fn in (t1, t2(True), t2(False)):
                tic = time.perf_counter()
                fn()
                costs.append(1000 * (time.perf_counter() - tic))
                _restore(cache.layers, snap)
            ratios["t2"].append(costs[1] / costs[0])
            ratios["t2_nocapture"].append(costs[2] / costs[0])
            ratios["capture_rollback_ms"].append(costs[1] - costs[2])
    res["t2_over_t1_paired"] = round(statistics.median(ratios["t2"]), 3)
    res["t2_nocapture_over_t1_paired"] = round(statistics.median(ratios["t2_nocapture"]), 3)
    res["capture_rollback_ms_paired"] = round(statistics.median(ratios["capture_rollback_ms"]), 3)

    greedy = [RowSampler(SamplingOptions(max_tokens=10**6)) for _ in range(B)]
    h_new = mx.zeros((B, 1, model.args.hidden_size), rows.hidden[0].dtype)
    states = [r.spec for r in batch.rows]  # each row's MTPRowState
    msnap = _snapshot(batch.head)

    def tm() -> None:  # one new verified pair per row, as after an all-rejected step, then a draft
        for i, r in enumerate(states):
            r.pending_h, r.pending_t, r.skipped = [], [], 0
            r.add_pending(h_new, i, [int(x[i, 0].item())])
        proposal = mtp.proposer.propose(1, states, batch.head, [True] * B, greedy)
        mx.eval(proposal.drafts, [c.state for c in batch.head])
        _restore(batch.head, msnap)

    res["tm_ms"] = median_ms(tm, iters)
    res["breakdown"] = breakdown(model, cache, snap, B, iters)
    return res


def breakdown(model: TextModel, cache: Any, snap: list, B: int, iters: int) -> dict:
    """Each layer kind alone at 1 and 2 tokens per row, every layer of the kind in one graph
    (one eval, as in a step): gated-delta layers (at 2 tokens with the verify's capture), their
    recurrence alone (per implementation), attention layers, lm_head + argmax."""
    inner = model.model
    H = model.args.hidden_size
    dtype = inner.embed_tokens.weight.dtype
    out: dict[str, Any] = {}
    for T in (1, 2):
        h = (mx.random.normal((B, T, H), key=mx.random.key(T)) * 0.5).astype(dtype)
        mx.eval(h)
        lin_layers = [(layer, c) for layer, c in zip(inner.layers, cache.layers) if layer.is_linear]
        fa_layers = [(layer, c) for layer, c in zip(inner.layers, cache.layers) if not layer.is_linear]
        mask = create_attention_mask(h, fa_layers[0][1])  # as the forward builds it from its batch cache

        def gdn() -> None:
            outs, states = [], []
            for layer, c in lin_layers:
                if T == 1:
                    outs.append(layer(h, cache=c))
                else:
                    r, _, st = gated_delta_layer(layer.linear_attn, layer.input_layernorm(h), None, c, capture=True)
                    outs.append(h + r + layer.mlp(layer.post_attention_layernorm(h + r)))
                    states += st
                states.append(c.cache[1])
            mx.eval(outs, states)
            _restore(cache.layers, snap)

        def attn() -> None:
            outs = [layer(h, mask=mask, cache=c) for layer, c in fa_layers]
            mx.eval(outs, [c.state for _, c in fa_layers])
            _restore(cache.layers, snap)

        def head() -> None:
            mx.eval(mx.argmax(lm_head(model, inner.norm(h)), axis=-1))

        for name in VARIANTS:  # the gated-delta layers at T tokens with each variant
            try:
                with variant(model, name):
                    out[f"gdn_layers_T{T}_{name}_ms"] = median_ms(gdn, iters)
            except Exception as e:  # noqa: BLE001 - recorded in step_costs already
                out[f"gdn_layers_T{T}_{name}_error"] = f"{type(e).__name__}: {e}"[:200]
                _restore(cache.layers, snap)
        out[f"attention_layers_T{T}_ms"] = median_ms(attn, iters)
        out[f"lm_head_T{T}_ms"] = median_ms(head, iters)
        lin = lin_layers[0][0].linear_attn
        Hk, Hv, Dk, Dv = lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim
        ks = mx.random.split(mx.random.key(10 + T), 5)
        q = (mx.random.normal((B, T, Hk, Dk), key=ks[0]) * Dk**-0.5).astype(dtype)
        k = (mx.random.normal((B, T, Hk, Dk), key=ks[1]) * Dk**-0.5).astype(dtype)
        v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(dtype)
        a = mx.random.normal((B, T, Hv), key=ks[3]).astype(dtype)
        b = mx.random.normal((B, T, Hv), key=ks[4]).astype(dtype)
        state0 = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        mx.eval(q, k, v, a, b, state0)
        for name in ("loop", "fused", "compiled"):
            recurrence = backbone.RECURRENCES[name]  # what use_recurrence(name) makes the verify's

            def rec() -> None:
                res = [recurrence(layer.linear_attn, q, k, v, a, b, state0, None) for layer, _ in lin_layers]
                mx.eval(res)

            out[f"recurrence_{name}_T{T}_ms"] = median_ms(rec, iters)
    return {key: round(v, 3) for key, v in out.items()}


# -- prefill with and without the head ------------------------------------------------------------


def prefill_tax(model: TextModel, head: MTPHead, n_tokens: int, vocab: int, repeats: int) -> dict:
    """One prompt prefilled as the engine prefills it (``prefill_forward``, without a proposer and with the MTP
    head's, in the chunks the server would calibrate), without and with MTP, alternating; median seconds."""
    # as a server with --prefill-step-size 2048 would; a chunk never outgrows the prompt (one of at most 16 tokens
    # needs no measuring)
    budget = calibrate(model, max_chunk=min(2048, n_tokens), ratio=3.0, vocab_size=vocab)
    chunk = budget.chunk_tokens
    ids = mx.random.randint(10, vocab, (1, n_tokens), key=mx.random.key(3)).astype(mx.uint32)
    # mtp: the head over the prompt's last DEFAULT_PROMPT_PAIRS positions (the default); mtp_all:
    # over every position (--mtp-prompt-pairs all, the former way)
    strategies: dict[str, MTPProposer | None] = {"plain": None, "mtp": MTPProposer(head, 1),
                                                 "mtp_all": MTPProposer(head, 1, prompt_pairs=None)}

    def run(proposer: MTPProposer | None) -> float:
        state = PrefillState(backbone=model.make_cache(), prefill_to=n_tokens)
        t = time.perf_counter()
        for s in range(0, n_tokens, chunk):
            prefill_forward(model, proposer, ids[:, s : s + chunk], state)  # advances state.prefilled
        return time.perf_counter() - t

    times: dict[str, list[float]] = {name: [] for name in strategies}
    for r in range(repeats + 1):
        names = list(strategies)
        for name in names[r % len(names):] + names[: r % len(names)]:
            gc.collect()
            mx.clear_cache()
            t = run(strategies[name])
            if r:  # the first round compiles and plans
                times[name].append(t)
    med = {name: statistics.median(v) for name, v in times.items()}
    return {
        "prompt_tokens": n_tokens,
        "chunk_tokens": chunk,
        "seconds": {name: round(v, 4) for name, v in med.items()},
        "seconds_all": {name: [round(x, 4) for x in v] for name, v in times.items()},
        "mtp_over_plain": round(med["mtp"] / med["plain"], 3),
        "mtp_all_over_plain": round(med["mtp_all"] / med["plain"], 3),
    }


# -- the run ------------------------------------------------------------------------------------


def summarize(B: int, costs: dict, runs: dict[str, list[tuple[float, dict]]], acceptances: list[float]) -> dict:
    plain = [(p[0] + c[0]) / 2 for p, c in zip(runs["plain"], runs["plain_control"])]
    row: dict[str, Any] = {
        "batch": B,
        "plain_tok_s": round(statistics.median(plain), 1),
        "plain_control_ratio": round(statistics.median(c[0] / p[0] for p, c in
                                                       zip(runs["plain"], runs["plain_control"])), 3),
        **{key: (round(v, 3) if isinstance(v, float) else v) for key, v in costs.items()},
        "t2_over_t1": round(costs["t2_ms"] / costs["t1_ms"], 3),
        **{f"t2_{name}_over_t1": round(costs[f"t2_{name}_ms"] / costs[f"t1_{name}_ms"], 3) for name in VARIANTS
           if f"t2_{name}_ms" in costs},
    }
    for name, rs in runs.items():
        if name in ("plain", "plain_control"):
            continue
        drafted = sum(r[1]["drafted"] for r in rs)
        accepted = sum(r[1]["accepted"] for r in rs)
        a = accepted / drafted if drafted else 0.0
        speedup = statistics.median(r[0] / p for r, p in zip(rs, plain))
        ideal = (1 + a) * costs["t1_ms"] / (costs["t2_ms"] + costs["tm_ms"])
        row[name] = {
            "tok_s": round(statistics.median(r[0] for r in rs), 1),
            "speedup": round(speedup, 3),
            "speedup_per_round": [round(r[0] / p, 3) for r, p in zip(rs, plain)],
            "acceptance": round(a, 3),
            "ideal_speedup": round(ideal, 3),
            "efficiency": round(speedup / ideal, 3),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    global VARIANTS  # --variants narrows it for the whole run
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--acceptance", default="0.6,0.8,0.9", help="forced acceptance values")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64, help="decode tokens per request and run")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up round")
    ap.add_argument("--iters", type=int, default=10, help="timed repetitions of each step cost")
    ap.add_argument("--prefill-tokens", type=int, default=0, help="also time a prompt's prefill with/without MTP")
    ap.add_argument("--prefill-repeats", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop starting batch sizes after this (0: none)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="defaults for a CPU check: tiny shape, batches 1,2, a = 0.8, 8 tokens, 1 round")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"gated-delta recurrence variants to time (t1/t2, breakdown); must include {DEFAULT}")
    ap.add_argument("--out", type=Path, required=True)
    if ap.parse_args(argv).smoke:  # the smoke values are defaults: arguments given still count
        ap.set_defaults(shape="small", batches="1,2", acceptance="0.8", prompt_tokens=16, max_tokens=8, rounds=1,
                        iters=2)
    a = ap.parse_args(argv)
    VARIANTS = tuple(v for v in a.variants.split(",") if v)
    if DEFAULT not in VARIANTS or not set(VARIANTS) <= {"loop", "fused", "compiled", "compiled_layer"}:
        ap.error(f"--variants: a comma list of loop, fused, compiled, compiled_layer that includes {DEFAULT}")
    t_start = time.perf_counter()
    batches = [int(b) for b in a.batches.split(",")]
    acceptances = [float(x) for x in a.acceptance.split(",")]

    tok, tok_size, special = load_tokenizer()
    shape = SHAPES[a.shape]
    zero_ids = sorted(set(range(tok_size, shape["vocab_size"])) | set(special))
    t0 = time.perf_counter()
    model, head, n_backbone, n_head = build(shape, getattr(mx, a.dtype), zero_ids)
    build_s = time.perf_counter() - t0
    rng = __import__("random").Random(0)
    usable = [i for i in range(10, tok_size) if i not in set(special)]
    prompts = [[rng.choice(usable) for _ in range(a.prompt_tokens)] for _ in range(max(batches))]
    t0 = time.perf_counter()
    rows = Rows(model, head, prompts)
    prefill_s = time.perf_counter() - t0

    result: dict[str, Any] = {
        "benchmark": "mtp_shapes_bench",
        "shape": a.shape,
        "text_config": text_config(shape),
        "dtype": a.dtype,
        "params_backbone": n_backbone,
        "params_mtp_head": n_head,
        "acceptance_source": "FORCED: the verify agrees with each draft with probability a "
                             "(support.forced_acceptance); random weights",
        "commit": commit(),
        "device": device(),
        "versions": versions(),
        "k": 1,
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "rounds": a.rounds,
        "iters": a.iters,
        "build_s": round(build_s, 2),
        "batched_prefill_s": round(prefill_s, 2),
        "rows": [],
        "skipped_batches": [],
    }
    print(f"mtp_shapes: {a.shape} built in {build_s:.1f} s ({n_backbone / 1e9:.2f} B + head {n_head / 1e6:.0f} M), "
          f"{result['device']}, commit {result['commit']}", flush=True)

    def write() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")

    write()
    if a.prefill_tokens:
        result["prefill"] = prefill_tax(model, head, a.prefill_tokens, tok_size, a.prefill_repeats)
        result["prefill"]["head_share_of_params"] = round(n_head / n_backbone, 4)
        # A prefill's per-token matmuls: every layer's, no lm_head (only the last position's logits are read)
        emb = shape["vocab_size"] * shape["hidden_size"] * (1 if shape["tie_word_embeddings"] else 2)
        result["prefill"]["head_share_of_layer_params"] = round(n_head / (n_backbone - emb), 4)
        print("mtp_shapes: prefill " + json.dumps(result["prefill"]), flush=True)
        write()

    last_batch_s = 0.0
    for B in batches:
        elapsed = time.perf_counter() - t_start
        # a batch size takes about as long as the one before it, and more with more rows
        if a.budget_s and elapsed + 1.3 * last_batch_s > a.budget_s:
            result["skipped_batches"].append(B)
            print(f"mtp_shapes: skip batch {B} ({elapsed:.0f} s of {a.budget_s:.0f} s used)", flush=True)
            continue
        tb = time.perf_counter()
        configs: dict[str, Callable[[], MTPDecode | None]] = {"plain": lambda: None}
        for acc in acceptances:
            configs[f"mtp_a{acc}"] = lambda acc=acc: ForcedAcceptanceDecode(head, acc, k=1, adaptive=False, seed=B)
            if B > 1:
                configs[f"aon_a{acc}"] = lambda acc=acc: ForcedAcceptanceDecode(
                    head, acc, k=1, adaptive=False, per_row_acceptance=False, seed=B)
        configs["plain_control"] = lambda: None
        names = list(configs)
        runs: dict[str, list[tuple[float, dict]]] = {name: [] for name in names}
        # Rounds interleave the configurations in a rotated order; every speedup is against the
        # same round's two plain runs. Round 0 is the warm-up (kernels compiled, attention planned).
        for rnd in range(a.rounds + 1):
            for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                gc.collect()
                mx.clear_cache()
                decode = configs[name]()
                timed = decode_run(model, tok, rows, B, a.max_tokens, decode)
                if rnd:
                    runs[name].append((timed.tokens / timed.seconds, decode.stats() if decode is not None else {}))
        costs = step_costs(model, head, tok, rows, B, a.iters)
        row = summarize(B, costs, runs, acceptances)
        row["seconds"] = round(time.perf_counter() - tb, 1)
        last_batch_s = row["seconds"]
        result["rows"].append(row)
        write()
        brief = {key: row[key] for key in ("batch", "plain_tok_s", "plain_control_ratio", "t1_ms", "t2_ms", "tm_ms",
                                           "t2_over_t1", "t2_over_t1_paired", "capture_rollback_ms_paired", "seconds")}
        brief.update({f"t2_{n}_over_t1": row.get(f"t2_{n}_over_t1") for n in VARIANTS})
        brief.update({name: [row[name]["speedup"], row[name]["acceptance"], row[name]["efficiency"]]
                      for name in names if name not in ("plain", "plain_control")})
        print("mtp_shapes: " + json.dumps(brief), flush=True)
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
