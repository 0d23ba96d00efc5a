#!/usr/bin/env python3
"""Per-step decode costs of mlx-lm's qwen3_5 TextModel, and the MTP speedup they allow.

Measures, on random weights generated on the device (no checkpoint needed), at each batch size:
  t1  one decode step: 1 token per row through the backbone + lm_head + argmax
  t2  one verify step: 2 tokens per row (the token and one MTP draft) + lm_head + argmax
  tm  one MTP head step: fc + one full-attention layer + norm + lm_head + argmax on 1 token per row
and projects the speedup of MTP decoding with one draft and acceptance a:
  speedup = (1 + a) * t1 / (t2 + tm)
(each verify+draft round emits 1 + a tokens on average, plain decoding emits one per t1).

Every step ends in mx.eval, as a decode loop that reads its tokens back does; the cache grows by
one or two tokens a step from a prompt of --context tokens.

  python benchmarks/step_costs.py --preset tiny --out benchmarks/results/step_costs_cpu.json
  python benchmarks/step_costs.py --preset qwen35-2b --out step_costs_gpu.json     # on a GPU
  python benchmarks/step_costs.py --reproject step_costs_gpu.json --acceptance 0.87,0.69
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

# Qwen3.5-2B's text shape (hidden 2048, 24 layers, [GDN x3, attention] x6, tied embeddings). Values
# other than hidden/layers/vocab follow the published 0.8B config scaled to 2B; random weights.
PRESETS = {
    "qwen35-2b": {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "vocab_size": 248320, "tie_word_embeddings": True, "full_attention_interval": 4,
    },
    # the trained tiny model's shape (models/tiny-qwen35-trained)
    "tiny": {
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
        "vocab_size": 4096, "tie_word_embeddings": False, "full_attention_interval": 4,
    },
}
COMMON = {
    "model_type": "qwen3_5_text", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "attention_bias": False, "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}


def build(text_config: dict, dtype_name: str):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3_5 import DecoderLayer, TextModel, TextModelArgs

    args = TextModelArgs.from_dict(text_config)
    model = TextModel(args)

    class MTP(nn.Module):  # the module vllm_mlx's inject_mtp_support builds
        def __init__(self):
            super().__init__()
            H = args.hidden_size
            self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
            self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.layers = [DecoderLayer(args, layer_idx=args.full_attention_interval - 1)]
            self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    mtp = MTP()
    dtype = getattr(mx, dtype_name)
    for m in (model, mtp):  # A_log stays fp32, as mlx-lm's cast_predicate keeps it
        m.update(tree_unflatten([(k, v if k.endswith("A_log") else v.astype(dtype))
                                 for k, v in tree_flatten(m.parameters())]))
    mx.eval(model.parameters(), mtp.parameters())
    model.train(False)  # as mlx-lm's load() leaves it: the gated-delta layer uses its kernel only in eval
    mtp.train(False)

    def head(h):
        if args.tie_word_embeddings:
            return model.model.embed_tokens.as_linear(h)
        return model.lm_head(h)

    def mtp_step(hidden, next_tok, cache):
        from mlx_lm.models.base import create_attention_mask

        e = mtp.pre_fc_norm_embedding(model.model.embed_tokens(next_tok))
        x = mtp.fc(mx.concatenate([e, mtp.pre_fc_norm_hidden(hidden)], -1))
        x = mtp.layers[0](x, mask=create_attention_mask(x, cache[0]), cache=cache[0])
        return head(mtp.norm(x))

    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return model, head, mtp_step, (lambda: [KVCache()]), n_params


def time_steps(fn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - t))
    return out


def measure(text_config: dict, dtype: str, batches: list[int], context: int, warmup: int, iters: int) -> dict:
    import mlx.core as mx

    model, head, mtp_step, make_mtp_cache, n_params = build(text_config, dtype)
    V = text_config["vocab_size"]
    rows = []
    for B in batches:
        mx.random.seed(B)
        res = {"batch": B}
        for name, width in (("t1", 1), ("t2", 2)):
            cache = model.make_cache()
            mx.eval(model(mx.random.randint(0, V, (B, context)), cache=cache), [c.state for c in cache])
            tok = mx.random.randint(0, V, (B, width))

            def step():
                h = model.model(tok, cache=cache)
                mx.eval(mx.argmax(head(h), axis=-1))

            res[f"{name}_ms"] = statistics.median(time_steps(step, warmup, iters))
        hidden = mx.random.normal((B, 1, text_config["hidden_size"])).astype(getattr(mx, dtype))
        nxt = mx.random.randint(0, V, (B, 1))
        mcache = make_mtp_cache()
        mx.eval(mtp_step(mx.random.normal((B, context, text_config["hidden_size"])).astype(hidden.dtype),
                         mx.random.randint(0, V, (B, context)), mcache))
        res["tm_ms"] = statistics.median(
            time_steps(lambda: mx.eval(mx.argmax(mtp_step(hidden, nxt, mcache), axis=-1)), warmup, iters))
        rows.append(res)
        print(json.dumps(res), flush=True)
    return {"params": int(n_params), "rows": rows}


def project(rows: list[dict], acceptances: list[float]) -> list[dict]:
    """Speedup (1 + a) * t1 / (t2 + tm) at each acceptance; the first one is the headline."""
    out = []
    for r in rows:
        r = dict(r)
        cost = r["t2_ms"] + r["tm_ms"]
        r["projected_by_acceptance"] = {f"{a:.4f}": (1 + a) * r["t1_ms"] / cost for a in acceptances}
        r["acceptance"] = acceptances[0]
        r["projected_mtp_speedup"] = (1 + acceptances[0]) * r["t1_ms"] / cost
        r["breakeven_acceptance"] = cost / r["t1_ms"] - 1
        out.append(r)
    return out


def device_line() -> str:
    import mlx.core as mx

    dev = mx.default_device()
    line = f"MLX {mx.__version__} {dev}"
    try:
        if dev == mx.gpu and mx.cuda.is_available():
            import subprocess

            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            line += f" (CUDA: {gpu})"
    except Exception:  # noqa: BLE001 - the device line is informative only
        pass
    return f"{line}; {platform.machine()} {platform.processor() or ''} Python {platform.python_version()}".strip()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--acceptance", default=None, help="MTP acceptance(s) for the projection, comma-separated")
    ap.add_argument("--acceptance-from", default=None, help="trained_model.json to read the acceptance from")
    ap.add_argument("--reproject", default=None, help="recompute the projection of a saved result file")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    acceptance = [float(x) for x in a.acceptance.split(",")] if a.acceptance else None
    if acceptance is None and a.acceptance_from and Path(a.acceptance_from).exists():
        acc = json.loads(Path(a.acceptance_from).read_text())["acceptance"]
        acceptance = [acc["greedy_decode"], acc["teacher_forced_agreement"]]
    if a.reproject:
        res = json.loads(Path(a.reproject).read_text())
    else:
        cfg = {**COMMON, **PRESETS[a.preset]}
        res = {"preset": a.preset, "dtype": a.dtype, "context": a.context, "iters": a.iters,
               "device": device_line(), "text_config": cfg}
        res.update(measure(cfg, a.dtype, [int(b) for b in a.batches.split(",")], a.context, a.warmup, a.iters))
    if acceptance is not None:
        res["rows"] = project(res["rows"], acceptance)
        res["acceptance"] = acceptance
        if a.acceptance_from:
            res["acceptance_source"] = f"{a.acceptance_from}: greedy_decode, teacher_forced_agreement"
    text = json.dumps(res, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    print("| batch | t1 ms | t2 ms | tm ms | speedup |")
    for r in res["rows"]:
        sp = r.get("projected_mtp_speedup")
        print(f"| {r['batch']} | {r['t1_ms']:.2f} | {r['t2_ms']:.2f} | {r['tm_ms']:.2f} | "
              f"{'-' if sp is None else f'{sp:.2f}'} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
