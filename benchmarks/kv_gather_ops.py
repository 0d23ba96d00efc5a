"""Per-op cost of the KV blocks' read path against the dense layout's, at a decode step's shapes:
the gather of every row's blocks, attention over the gathered keys (as gathered, transposed, or
made contiguous first), and the dense layout's slice; one layer, timed over many launches.

    python benchmarks/kv_gather_ops.py --batch 4 --context 256 --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vllm_mlx_mtp_routing.model.kernels.kv_gather import _copy_kernel_fits, gather_rows  # noqa: E402


def timed(fn, n: int = 200) -> float:
    for _ in range(10):
        mx.eval(fn())
    mx.synchronize()
    tic = time.perf_counter()
    outs = [fn() for _ in range(n)]
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - tic) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    B, H, Hq, D, n = a.batch, a.kv_heads, a.heads, a.head_dim, a.context
    dt = mx.bfloat16
    blocks_per_row = -(-n // a.block)
    slots = (B * blocks_per_row + 1) * a.block
    pool = mx.random.normal((H, slots, D)).astype(dt)
    # rows' blocks interleaved, as rows that grew together hold them
    table = mx.array([[1 + j * B + i for j in range(blocks_per_row)] for i in range(B)], dtype=mx.int32)
    idx = (table[:, :, None] * a.block + mx.arange(a.block, dtype=mx.int32)).reshape(B, -1)[:, :n]
    dense = mx.random.normal((B, H, n + 256, D)).astype(dt)
    q = mx.random.normal((B, Hq, 1, D)).astype(dt)
    mask = mx.ones((B, 1, 1, n), dtype=mx.bool_)
    scale = D ** -0.5
    mx.eval(pool, idx, dense, q, mask)
    res = {"device": str(mx.default_device()), "args": vars(a)}
    token = mx.zeros((H, B, D), dt)
    slot = idx[:, -1]

    def write(p: mx.array) -> mx.array:  # as update_and_fetch writes: a scatter into the pool, donated
        p[:, slot] = token
        return p

    pos = mx.full((B, 1, 1, 1), n, dtype=mx.int32)

    held = [dense]

    def write_dense() -> mx.array:  # the dense layout's put_along_axis, its buffer replaced (donated)
        held[0] = mx.put_along_axis(held[0], pos, mx.zeros((B, H, 1, D), dt), axis=2)
        return held[0]

    gathered = lambda: pool[:, idx].transpose(1, 0, 2, 3)
    pool_sm = mx.contiguous(pool.transpose(1, 0, 2))
    mx.eval(pool_sm)
    took = lambda: mx.take(pool, idx.reshape(-1), axis=1).reshape(H, B, n, D).transpose(1, 0, 2, 3)
    if _copy_kernel_fits(pool, pool):  # the package's copy kernel (CUDA): keys and values in one launch
        ref = gathered()
        got_k, got_v = gather_rows(pool, pool, idx)
        res["block_gather_equal"] = bool(mx.array_equal(ref, got_k).item() and mx.array_equal(ref, got_v).item())
        print("block_gather_equal", res["block_gather_equal"], flush=True)
        cases_extra = {
            "block_gather_kv": lambda: gather_rows(pool, pool, idx),
            "sdpa_block_gather": lambda: mx.fast.scaled_dot_product_attention(q, *gather_rows(pool, pool, idx), scale=scale, mask=mask),
        }
    else:
        cases_extra = {}
    cases = {
        "gather": lambda: pool[:, idx],
        "gather_contiguous": lambda: mx.contiguous(gathered()),
        "dense_slice_contiguous": lambda: mx.contiguous(dense[..., :n, :]),
        "sdpa_dense_slice": lambda: mx.fast.scaled_dot_product_attention(q, dense[..., :n, :], dense[..., :n, :], scale=scale, mask=mask),
        "sdpa_dense_slice_nomask": lambda: mx.fast.scaled_dot_product_attention(q, dense[..., :n, :], dense[..., :n, :], scale=scale),
        "sdpa_gathered_transposed": lambda: mx.fast.scaled_dot_product_attention(q, gathered(), gathered(), scale=scale, mask=mask),
        "sdpa_gathered_contiguous": lambda: mx.fast.scaled_dot_product_attention(q, mx.contiguous(gathered()), mx.contiguous(gathered()), scale=scale, mask=mask),
        "take_axis1": lambda: mx.take(pool, idx.reshape(-1), axis=1),
        "slot_major_take": lambda: mx.take(pool_sm, idx.reshape(-1), axis=0),
        "sdpa_take_axis1": lambda: mx.fast.scaled_dot_product_attention(q, took(), took(), scale=scale, mask=mask),
        "scatter_one_token": lambda: write(pool),
        "dense_put_one_token": write_dense,
    }
    cases.update(cases_extra)
    for name, fn in cases.items():
        res[name + "_us"] = round(timed(fn), 1)
        print(name, res[name + "_us"], "us", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
