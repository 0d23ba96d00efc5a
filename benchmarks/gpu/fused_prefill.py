#!/usr/bin/env python3
"""The text model with mlx-lm's gated-delta loop vs the fused CUDA recurrence (recurrence.py), in
one run on one model: prefill time of N prompt tokens (in --prefill-step-size chunks), a decode
step at batch 1 and 4, a 2-token MTP verify (backbone_forward with capture), greedy tokens of
both, and the prefill chunk the engine's time budget picks with each.

  python benchmarks/gpu/fused_prefill.py --model /root/qwen35-2b --out $OUT/fused_prefill.json   # CUDA machine
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vllm_mlx_mtp_routing.model.backbone import FusedGatedDeltaNet, backbone_forward  # noqa: E402
from vllm_mlx_mtp_routing.model.mlx_lm_internals import GatedDeltaNet  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.prefill_budget import calibrate, median_seconds  # noqa: E402


def set_recurrence(model, cls) -> None:
    for layer in model.model.layers:
        if layer.is_linear:
            layer.linear_attn.__class__ = cls


def prefill(model, ids: mx.array, chunk: int) -> list:
    cache = model.make_cache()
    for s in range(0, ids.shape[1], chunk):
        mx.eval(model(ids[:, s : s + chunk], cache=cache))
    return cache


def measure(model, ids: mx.array, chunk: int, greedy: int) -> dict:
    r = {}
    for n in sorted({min(512, ids.shape[1]), min(2048, ids.shape[1]), ids.shape[1] - 8}):
        prefill(model, ids[:, :n], chunk)
        r[f"prefill_{n}_s"] = median_seconds(lambda: prefill(model, ids[:, :n], chunk), 2)
    ctx = min(256, ids.shape[1] // 2)
    for b in (1, 4):
        cache = prefill(model, mx.repeat(ids[:, :ctx], b, 0), chunk)
        tok = mx.repeat(ids[:, ctx : ctx + 1], b, 0)
        step = lambda: mx.eval(model(tok, cache=cache))  # noqa: E731
        step()
        r[f"decode_b{b}_ms"] = 1e3 * median_seconds(step, 10)
        two = mx.concatenate([tok, tok], axis=1)
        verify = lambda: mx.eval(backbone_forward(model, two, cache, capture=True)[:2])  # noqa: E731
        verify()
        r[f"verify2_b{b}_ms"] = 1e3 * median_seconds(verify, 10)
    ctx = min(1024, ids.shape[1] // 2)
    cache = prefill(model, ids[:, :ctx], chunk)
    out, tok = [], None
    logits = model(ids[:, ctx : ctx + 1], cache=cache)
    for _ in range(greedy):
        tok = mx.argmax(logits[:, -1], axis=-1)
        out.append(int(tok.item()))
        logits = model(tok[:, None], cache=cache)
    r["greedy"] = out
    b = calibrate(model, max_chunk=chunk, ratio=3.0, vocab_size=int(model.args.vocab_size))
    r["budget"] = b.stats()
    return r


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return "no GPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--greedy", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    vlm, _ = load(str(a.model))
    model = build_text_model(vlm, a.model, json.loads((a.model / "config.json").read_text()), enable_mtp=False).model
    ids = mx.random.randint(0, 4000, (1, a.tokens + 8), key=mx.random.key(0))
    res = {
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip(),
        "device": f"{mx.default_device()} {gpu_name()}",
        "mlx": mx.__version__, "model": str(a.model), "tokens": a.tokens, "chunk": a.chunk,
    }
    for name, cls in (("fused", FusedGatedDeltaNet), ("mlx_lm_loop", GatedDeltaNet)):
        set_recurrence(model, cls)
        res[name] = measure(model, ids, a.chunk, a.greedy)
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "greedy"}), flush=True)
    f, l = res["fused"], res["mlx_lm_loop"]
    res["greedy_agree"] = sum(x == y for x, y in zip(f["greedy"], l["greedy"]))
    res["ratios_loop_over_fused"] = {k: l[k] / f[k] for k in f if k.endswith(("_s", "_ms"))}
    print(json.dumps({"greedy_agree": res["greedy_agree"], "ratios": res["ratios_loop_over_fused"]}), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
