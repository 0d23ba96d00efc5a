#!/usr/bin/env python3
"""What a prefill chunk of a length the process has not run before costs once, and where it goes.

A prompt's last chunk is as long as what is left of it: a new prompt length is a new chunk length, and on
MLX's CUDA backend the first forward at a new length paid 0.05-0.09 s more than the next one (BENCHMARKS.md
section 7) beyond what the depthwise conv cost. Here, over a cache --position tokens deep, each of --lengths is
run twice through the whole model (first: its one-off costs; second: steady), and then every distinct matmul shape
of the model's linear layers (x @ W.T per weight shape) alone, twice, at a row count no forward has run: the
matmuls' share of the one-off. (Causal attention's first call at a new query length: benchmarks/shape_compiles.py.)

  python benchmarks/tail_compiles.py --shape 2b --lengths 300,301,417,513,592 --out tail_compiles-gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import kv_layout_ab as ab  # noqa: E402
import provenance  # noqa: E402
from vllm_mlx_mtp_routing.model.mlx_lm_internals import KVCache  # noqa: E402


def timed(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def weight_shapes(model: nn.Module) -> list[tuple[int, int, str]]:
    """The distinct (out, in) shapes of the model's plain linear layers (a quantized layer is another kernel)."""
    shapes: dict[tuple[int, int], str] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            shapes.setdefault(tuple(m.weight.shape), name)
    return [(o, i, name) for (o, i), name in sorted(shapes.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2b", choices=["trained", "2b", "small"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--position", type=int, default=4096)
    ap.add_argument("--lengths", default="300,301,417,513,592")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model, make_prompts, info = ab.load_model(a.shape, a.dtype)
    lengths = [int(n) for n in a.lengths.split(",")]
    prompt = mx.array(make_prompts(1, a.position + max(lengths) + 64)[0], dtype=mx.uint32)[None]
    cache = model.make_cache()
    layers = [c for c in cache if isinstance(c, KVCache)]
    for s in range(0, a.position, 512):  # prefill in one chunk size: its shapes are warm before the first length
        mx.eval(model(prompt[:, s : min(s + 512, a.position)], cache=cache))
    dtype = getattr(mx, a.dtype)
    shapes = weight_shapes(model)
    rows = []
    for n in lengths:
        tokens = prompt[:, a.position : a.position + n]

        def forward() -> None:
            mx.eval(model(tokens, cache=cache))
            for c in layers:
                c.trim(n)

        first, second = timed(forward), timed(forward)
        row = {"length": n, "forward_first_s": round(first, 4), "forward_second_s": round(second, 4),
               "one_off_s": round(first - second, 4)}
        m = n + 7  # a length none of the forwards above ran: the parts' own first calls
        x = mx.random.normal((1, m, 1), dtype=mx.float32).astype(dtype)
        parts = {}
        for out, inp, name in shapes:
            w = mx.random.normal((out, inp)).astype(dtype)
            xi = mx.broadcast_to(x, (1, m, inp))
            mx.eval(w, xi)
            f = timed(lambda: mx.eval(xi @ w.T))
            s_ = timed(lambda: mx.eval(xi @ w.T))
            parts[f"matmul {m}x{inp}x{out} ({name})"] = [round(f, 4), round(s_, 4)]
        row["parts_at_length"] = m
        row["parts"] = parts
        row["matmul_one_off_s"] = round(sum(f - s_ for f, s_ in parts.values()), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"benchmark": "tail_compiles", **provenance.record(), "model": info, "config": vars(a) | {"out": str(a.out)},
              "results": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
