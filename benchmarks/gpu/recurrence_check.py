#!/usr/bin/env python3
"""The fused gated-delta kernel on MLX's CUDA backend against mlx-lm's loop: exactness properties
(chunked = whole, batched = alone, capture = per-position runs) and time per call at the
Qwen3.5-2B / 9B linear-attention shapes. Writes a JSON result; run on a CUDA machine."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_ops

from vllm_mlx_mtp_routing.model.kernels.device import on_cuda
from vllm_mlx_mtp_routing.model.kernels.recurrence import gated_delta_fused

SHAPES = {"2b": dict(Hk=16, Hv=16, Dk=128, Dv=128), "9b": dict(Hk=16, Hv=32, Dk=128, Dv=128)}


def inputs(B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, dtype: mx.Dtype, seed: int = 0):
    mx.random.seed(seed)
    q = (mx.random.normal((B, T, Hk, Dk)) * Dk**-1).astype(dtype)
    k = mx.random.normal((B, T, Hk, Dk))
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    g = mx.exp(-mx.random.uniform(shape=(B, T, Hv)) * 0.3)
    beta = mx.sigmoid(mx.random.normal((B, T, Hv))).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.05
    return q, k, v, g, beta, state


def ops(q, k, v, g, beta, state, mask=None):
    r = v.shape[2] // q.shape[2]
    return gated_delta_ops(mx.repeat(q, r, -2) if r > 1 else q, mx.repeat(k, r, -2) if r > 1 else k, v, g, beta, state, mask)


def same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


def checks(dtype: mx.Dtype) -> dict:
    out = {}
    q, k, v, g, beta, s = inputs(4, 97, 2, 4, 64, 64, dtype)
    y0, s0 = ops(q, k, v, g, beta, s)
    y1, s1 = gated_delta_fused(q, k, v, g, beta, s)
    mx.eval(y0, s0, y1, s1)
    out["max_abs_diff_vs_mlx_lm_y"] = mx.abs(y1.astype(mx.float32) - y0.astype(mx.float32)).max().item()
    out["max_abs_diff_vs_mlx_lm_state"] = mx.abs(s1 - s0).max().item()
    out["y_scale"] = mx.abs(y0.astype(mx.float32)).max().item()
    # chunked = whole
    ya, sa = gated_delta_fused(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], s)
    yb, sb = gated_delta_fused(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:], sa)
    out["chunked_equals_whole"] = same(mx.concatenate([ya, yb], 1), y1) and same(sb, s1)
    # batched = alone
    alone = [gated_delta_fused(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], s[i : i + 1]) for i in range(4)]
    out["batched_equals_alone"] = all(same(a[0], y1[i : i + 1]) and same(a[1], s1[i : i + 1]) for i, a in enumerate(alone))
    # capture = per-position runs; last captured = final
    yc, sc = gated_delta_fused(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], s, capture=True)
    per = [gated_delta_fused(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], s)[1] for t in range(3)]
    out["capture_equals_per_position"] = all(same(sc[:, t], per[t]) for t in range(3)) and same(yc, y1[:, :3])
    # one position at a time = whole (decode steps vs prefill)
    st, ys = s, []
    for t in range(8):
        yt, st = gated_delta_fused(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], st)
        ys.append(yt)
    y8, s8 = gated_delta_fused(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], s)
    out["stepwise_equals_whole"] = same(mx.concatenate(ys, 1), y8) and same(st, s8)
    # mask: masked positions keep the state, output 0 (mlx-lm's semantics)
    mask = mx.array([[t >= 5 for t in range(97)]] * 4)
    ym0, sm0 = ops(q, k, v, g, beta, s, mask)
    ym1, sm1 = gated_delta_fused(q, k, v, g, beta, s, mask=mask)
    out["mask_max_abs_diff_state"] = mx.abs(sm1 - sm0).max().item()
    out["mask_max_abs_diff_y"] = mx.abs(ym1.astype(mx.float32) - ym0.astype(mx.float32)).max().item()
    return out


def timed(fn, reps: int) -> float:
    mx.eval(fn())
    mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t0) / reps


def timings(shape: dict, dtype: mx.Dtype) -> list[dict]:
    rows = []
    for B, T in [(1, 1), (1, 2), (1, 3), (4, 1), (4, 2), (8, 2), (1, 512), (1, 4096), (4, 512)]:
        q, k, v, g, beta, s = inputs(B, T, **shape, dtype=dtype)
        reps = 20 if T <= 3 else 3
        row = {"B": B, "T": T}
        row["mlx_lm_loop_ms"] = 1e3 * timed(lambda: ops(q, k, v, g, beta, s), reps)
        row["fused_ms"] = 1e3 * timed(lambda: gated_delta_fused(q, k, v, g, beta, s), reps)
        if T <= 3:
            row["fused_capture_ms"] = 1e3 * timed(lambda: gated_delta_fused(q, k, v, g, beta, s, capture=True), reps)
        try:
            row["mx_fast_ms"] = 1e3 * timed(lambda: mx.fast.gated_delta_update(q, k, v, g, beta, s), reps)
        except Exception as e:  # noqa: BLE001 (record why, go on)
            row["mx_fast_error"] = str(e)[:200]
        row["speedup"] = row["mlx_lm_loop_ms"] / row["fused_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not on_cuda():
        raise SystemExit("needs MLX's CUDA backend")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "device": gpu, "mlx": mx.__version__, "python": platform.python_version()}
    for name, dt in [("float32", mx.float32), ("bfloat16", mx.bfloat16)]:
        result[f"checks_{name}"] = checks(dt)
        print(name, json.dumps(result[f"checks_{name}"]), flush=True)
    for name, shape in SHAPES.items():
        result[f"timings_{name}_bf16"] = timings(shape, mx.bfloat16)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
