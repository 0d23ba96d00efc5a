#!/usr/bin/env python3
"""KV layouts side by side in one process: memory held and plain decode step time.

Layouts: ``pool`` (this checkout's RaggedKVCache: per-row blocks, gathered per step) and ``dense``
(the RaggedKVCache of another checkout, --base: one buffer, every row at the longest row's
capacity). Both batches hold the same prefilled rows; timed decode steps alternate between them
(blocks of --block steps, so a slow phase of a shared machine weighs on both), and the step
time ratio is pool / dense. The memory line is the issue's case: one long row (--long tokens)
beside seven 20-token rows, attention KV held / the rows' own needs (tokens held x bytes per token).
Steps: a plain decode step ([B, 1]) and an MTP verify step ([B, 2] with the gated-delta capture and
a per-row rollback, the verify of MTPDecode without the head).

A third layout, ``pool_gather``, is this checkout's with the lone row's slice read off
(``RaggedKVCache.slice_single_run``): at batch 1 ``pool`` reads the row's blocks as a slice of the
pool when they are one run, ``pool_gather`` always gathers (what the pool did before).

Model: ``--shape trained`` (default) loads models/tiny-qwen35-trained; ``--shape 2b`` / ``small``
builds a Qwen3.5-2B-shaped (or tiny) text model in memory with random bf16 weights
(mtp_shapes_bench.build, in eval mode) and uses random prompt ids: the step cost of a realistic
shape, where weights rather than launches and KV copies should dominate.

  python benchmarks/kv_layout_ab.py --base ../checkout-before --out kv_ab.json
  python benchmarks/kv_layout_ab.py --base ../checkout-before --shape 2b --out kv_ab_2b.json   # a GPU
  python benchmarks/kv_layout_ab.py --base ../checkout-before --shape small --steps 24         # CPU check
Only ``vllm_mlx_mtp_routing/text_engine/batch_cache.py`` of the --base checkout is read.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import mtp_decode_bench as mb  # noqa: E402
import provenance  # noqa: E402
from vllm_mlx_mtp_routing.model.backbone import backbone_forward, rollback_rows  # noqa: E402
from vllm_mlx_mtp_routing.text_engine import batch_cache as pool_mod  # noqa: E402


def load_layout(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prefilled(model, prompt):
    c = model.make_cache()
    model(mx.array(prompt[:-1], dtype=mx.uint32)[None], cache=c)
    mx.eval([x.state for x in c])
    return c


def batch(mod, model, rows):
    bc = mod.BatchCache(model)
    for r in rows:
        bc.add_row(r)
    mx.eval(bc.state())
    return bc


def kv_bytes(mod, bc) -> tuple[int, int]:
    """(held, own need) over the attention layers."""
    held = need = 0
    for c in bc.layers:
        if isinstance(c, mod.RaggedKVCache) and not c.empty():
            held += c.nbytes
            k = c.state[0]
            per_slot = c.nbytes // (k.shape[1] if k.ndim == 3 else k.shape[0] * k.shape[2])
            need += per_slot * sum(c.lengths)
    return held, need


def load_model(shape: str, dtype: str):
    """(model, prompt ids source, provenance) for --shape."""
    if shape == "trained":
        _, bundle, tok, _ = mb.load_bundle(None)
        return bundle.model, lambda n, length: mb.make_prompts(tok, n, length), {"model": "models/tiny-qwen35-trained"}
    import mtp_shapes_bench as sb

    tok, tok_size, special = sb.load_tokenizer()
    cfg = sb.SHAPES[shape]
    zero_ids = sorted(set(range(tok_size, cfg["vocab_size"])) | set(special))
    t0 = time.perf_counter()
    model, _, n_params, _ = sb.build(cfg, getattr(mx, dtype), zero_ids)
    info = {"model": f"{shape}-shaped, random {dtype} weights, built in memory", "params": n_params,
            "build_s": round(time.perf_counter() - t0, 1), "text_config": {**sb.COMMON, **cfg}}
    rng = np.random.default_rng(0)
    return model, lambda n, length: rng.integers(0, tok_size - 1, size=(n, length)).tolist(), info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--long", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--alt", type=Path, default=None, help="another batch_cache.py to time beside them")
    ap.add_argument("--shape", choices=("trained", "2b", "small"), default="trained")
    ap.add_argument("--dtype", default="bfloat16", help="weights of a built --shape")
    ap.add_argument("--no-gather-layout", action="store_true", help="leave out pool_gather")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    layouts = {"pool": pool_mod, "dense": load_layout(a.base / "vllm_mlx_mtp_routing/text_engine/batch_cache.py", "dense_bc")}
    if not a.no_gather_layout:
        layouts["pool_gather"] = pool_mod
    if a.alt:
        layouts["alt"] = load_layout(a.alt, "alt_bc")
    model, make_prompts, info = load_model(a.shape, a.dtype)
    res = {"device": mb.gpu_name() or f"{platform.machine()} CPU ({os.cpu_count()} cores)", **info,
           **provenance.record(), "args": {k: str(v) for k, v in vars(a).items()}, "steps": {}, "memory": {}}

    def batch_of(name: str, rows: list) -> object:
        bc = batch(layouts[name], model, rows)
        if name == "pool_gather":
            for c in bc.layers:
                if isinstance(c, pool_mod.RaggedKVCache):
                    c.slice_single_run = False
        return bc

    prompts = make_prompts(8, max(a.context, 20))
    if a.long:
        longp = (prompts[0] * (a.long // len(prompts[0]) + 1))[: a.long]
        rows = [prefilled(model, longp)] + [prefilled(model, p[:21]) for p in prompts[1:8]]
        for name, mod in layouts.items():
            held, need = kv_bytes(mod, batch_of(name, rows))
            res["memory"][name] = {"held_bytes": held, "own_need_bytes": need, "ratio": held / need}
            print(f"memory {name}: {held / 2**20:.2f} MiB held for {need / 2**20:.2f} MiB own need ({held / need:.2f}x)")
        del rows

    for B in [int(b) for b in a.batches.split(",")]:
        rows = [prefilled(model, p[: a.context]) for p in prompts[:B]]
        caches = {n: batch_of(n, rows) for n in layouts}
        x = mx.array([[p[a.context - 1]] for p in prompts[:B]], dtype=mx.uint32)
        keep = [1 + (i % 2) for i in range(B)]  # a verify: half the rows accept their draft

        def plain(bc):
            logits = model(x, cache=bc.layers)[:, -1, :]
            mx.eval(mx.argmax(logits, axis=-1), bc.state())

        def verify(bc):  # [token, draft] per row, gated-delta states captured, per-row rollback
            logits, _, captured = backbone_forward(model, mx.concatenate([x, x], axis=1), bc.layers, capture=True)
            mx.eval(mx.argmax(logits, axis=-1))
            rollback_rows(bc.layers, captured, keep, 2)
            mx.eval(bc.state())

        res["steps"][B] = {}
        for kind, fn in (("plain", plain), ("verify", verify)):
            times = {n: [] for n in layouts}
            blocks = {n: [] for n in layouts}  # per alternation: the block's median step
            for s in range(a.steps // a.block + 1):
                for name in (list(layouts) if s % 2 == 0 else list(reversed(layouts))):
                    ts = []
                    for _ in range(a.block):
                        t = time.perf_counter()
                        fn(caches[name])
                        ts.append(time.perf_counter() - t)
                    if s:  # the first block of each warms up
                        times[name] += ts
                        blocks[name].append(statistics.median(ts))
            med = {n: statistics.median(t) for n, t in times.items()}
            # the ratio of neighbouring blocks (seconds apart), median over alternations: a slow
            # phase of a shared machine falls on both sides of most ratios
            paired = {n: statistics.median(x / y for x, y in zip(b, blocks["dense"])) for n, b in blocks.items() if n != "dense"}
            res["steps"][B][kind] = {**{f"{n}_ms": t * 1e3 for n, t in med.items()},
                                     **{f"{n}_over_dense": r for n, r in paired.items()}}
            print(f"B={B} {kind}: step " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in med.items()) + "; paired "
                  + ", ".join(f"{n}/dense {r:.3f}" for n, r in paired.items()), flush=True)
        if a.out:  # after every batch size: a cut run keeps what it measured
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
