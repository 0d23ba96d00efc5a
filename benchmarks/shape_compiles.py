#!/usr/bin/env python3
"""Which of the KV pool's operations pay a one-off cost at a new array size (first call against second).

The text engine's attention KV lives in a pool of blocks (text_engine/batch_cache.py) whose size changes as it grows
and is compacted; on MLX's CUDA backend a step after a long row left the batch once took 3.6 s (BENCHMARKS.md
section 7). For each of a few pool sizes, never seen before in the process: the rows' gather from the pool, a
scatter of new keys into it, the pool's growth by concatenation, a compaction's take, and attention over a new key
span (one and two query tokens), each timed at its first and second call.

  python benchmarks/shape_compiles.py --out shape_compiles-gpu.json      # a GPU
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

import provenance  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels import causal_conv  # noqa: E402


def twice(fn) -> list[float]:
    out = []
    for _ in range(2):
        tic = time.perf_counter()
        mx.eval(fn())
        out.append(round(time.perf_counter() - tic, 4))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="300,301,340,520,1000,1031")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--query-lengths", default="479,480,613,1000,1136",
                    help="then: causal attention of chunks of these lengths over 8K earlier keys (a prompt's last chunk)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    block, H, D, B = 64, a.heads, a.dim, a.rows
    dt = mx.bfloat16
    results = []
    for nb in (int(x) for x in a.blocks.split(",")):
        pool = mx.zeros((H, nb * block, D), dt)
        mx.eval(pool)
        span = 768
        idx = (mx.arange(B * span) % (nb * block)).reshape(B, span).astype(mx.int32)
        new = mx.ones((H, B, D), dt)
        slots = mx.arange(B, dtype=mx.int32) * 7 + 64
        order = mx.arange(nb * block - 64, dtype=mx.int32)
        q1 = mx.ones((B, H * 4, 1, D), dt)
        q2 = mx.ones((B, H * 4, 2, D), dt)
        kv_len = 64 * (nb // 4)  # a new key span too
        k = mx.ones((B, H, kv_len, D), dt)

        def scatter():
            p = mx.array(pool)
            p[:, slots] = new
            return p

        row = {
            "blocks": nb,
            "gather": twice(lambda: pool[:, idx].transpose(1, 0, 2, 3)),
            "scatter": twice(scatter),
            "grow": twice(lambda: mx.concatenate([pool, mx.zeros((H, 64 * block, D), dt)], axis=1)),
            "compact": twice(lambda: pool[:, order]),
            "sdpa_q1": twice(lambda: mx.fast.scaled_dot_product_attention(q1, k, k, scale=0.06)),
            "sdpa_q2": twice(lambda: mx.fast.scaled_dot_product_attention(q2, k, k, scale=0.06)),
            "sdpa_q2_mask": twice(lambda: mx.fast.scaled_dot_product_attention(
                q2, k, k, scale=0.06, mask=mx.ones((B, 1, 2, kv_len), dtype=mx.bool_))),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    heads = H * 4
    for L in (int(x) for x in a.query_lengths.split(",") if x):
        S = 8192 + L
        q = mx.ones((1, heads, L, D), dt)
        k = mx.ones((1, H, S, D), dt)
        row = {"query_length": L, "keys": S,
               "sdpa_causal": twice(lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.06, mask="causal"))}
        results.append(row)
        print(json.dumps(row), flush=True)
    import mlx.nn as nn

    C = 6144  # the 2B shape's gated-delta conv channels
    conv = nn.Conv1d(C, C, 4, groups=C, bias=False)
    conv.set_dtype(dt)
    conv.train(False)
    for B, L in [(1, int(x)) for x in a.query_lengths.split(",") if x] + [(b, 1) for b in range(1, 9)] + [(b, 2) for b in range(1, 5)]:
        x = mx.random.normal((B, L + 3, C)).astype(dt)
        row = {"conv_batch": B, "conv_length": L, "depthwise_conv1d": twice(lambda: conv(x))}
        if causal_conv.supported(conv, x):  # this plugin's kernel (CUDA): its first call, its time, its values
            row["kernel"] = twice(lambda: causal_conv.depthwise_causal_conv(conv, x))
            ref, got = conv(x).astype(mx.float32), causal_conv.depthwise_causal_conv(conv, x).astype(mx.float32)
            row["kernel_max_abs_diff"] = mx.abs(ref - got).max().item()
            row["kernel_median_s"], row["conv_median_s"] = (
                round(sorted(twice(f) + twice(f) + twice(f))[3], 6)
                for f in (lambda: causal_conv.depthwise_causal_conv(conv, x), lambda: conv(x)))
        results.append(row)
        print(json.dumps(row), flush=True)
    import os

    out = {"benchmark": "shape_compiles", "cudnn_sdpa_env": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA"), **provenance.record(), "config": vars(a) | {"out": str(a.out)},
           "results": results}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
