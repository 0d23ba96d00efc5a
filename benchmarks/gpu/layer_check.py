#!/usr/bin/env python3
"""The gated-delta layer's one kernel (model/kernels/gated_delta_layer.py) on MLX's CUDA backend: its agreement with
the ops it replaces (to rounding), and the text path's exactness with it (a prompt in chunks = whole, a row batched =
alone, the verify's kept states = one-token steps), at the Qwen3.5-2B and 9B gated-delta shapes with random bf16
weights. Writes a JSON result; run on a CUDA machine (the `kernels` job).

  python benchmarks/gpu/layer_check.py --out layer_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from lib.random_model import build, text_config  # noqa: E402
from lib.shapes import PRESETS  # noqa: E402

from vllm_mlx_mtp_routing.model import backbone  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels import gated_delta_layer as fused_layer  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels.device import kind  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels.fused_projections import GATED_DELTA_INPUTS, project  # noqa: E402


def core(lin, x, conv_state, state, capture=False, fused=True):
    """The layer's core -> (output, next conv state, final state, kept states), fused or as the ops."""
    devices = set(fused_layer.fused_layer_devices)
    try:
        (fused_layer.fused_layer_devices.add if fused else fused_layer.fused_layer_devices.discard)(kind())
        out, conv_input, final, states = backbone._layer_core(lin, x, conv_state, state, None, capture,
                                                              window_only=not capture)
    finally:
        fused_layer.fused_layer_devices.clear()
        fused_layer.fused_layer_devices.update(devices)
    K = lin.conv1d.weight.shape[1]
    window = conv_input[:, -(K - 1):]
    mx.eval(out, window, final, *states)
    return out, window, final, states


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b).item())


def diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())


def check(shape: str) -> dict:
    model, _ = build(text_config(PRESETS[shape], layers=4), mx.bfloat16, [])
    lin = model.model.layers[0].linear_attn
    hidden = model.args.hidden_size
    K, C = lin.conv1d.weight.shape[1], lin.conv_dim
    mx.random.seed(1)

    def data(B: int, T: int):
        x = mx.random.normal((B, T, hidden)).astype(mx.bfloat16)
        conv_state = (mx.random.normal((B, K - 1, C)) * 0.5).astype(mx.bfloat16)
        state = mx.random.normal((B, lin.num_v_heads, lin.head_v_dim, lin.head_k_dim)) * 0.05
        return x, conv_state, state

    r: dict = {"shape": shape, "class": type(lin).__name__}
    x, cs, s = data(2, 33)
    ops_out, ops_win, ops_final, _ = core(lin, x, cs, s, fused=False)
    f_out, f_win, f_final, _ = core(lin, x, cs, s)
    scale = float(mx.max(mx.abs(ops_out.astype(mx.float32))).item())
    r["against_ops"] = {"out_max_abs": diff(f_out, ops_out), "out_max_abs_of_max": scale,
                        "state_max_abs": diff(f_final, ops_final), "window_equal": same(f_win, ops_win)}

    # The kernel alone from here on: the projections around it are matmuls whose kernels MLX picks by shape (a
    # documented CUDA limit), so each check feeds it the same projected inputs, sliced.
    def kernel(qkv, a, b, conv_state, state, capture=False, one_kernel=None):
        y, kept, window = fused_layer.gated_delta_layer(lin, qkv, conv_state, a, b, state, capture, one_kernel)
        mx.eval(y, kept, window)
        return y, kept, window

    qkv, _, b, a = project(lin, GATED_DELTA_INPUTS, x)
    y, final, window = kernel(qkv, a, b, cs, s)
    # a long call's two kernels against the one kernel of a short one, with and without the kept states
    y1, final1, window1 = kernel(qkv, a, b, cs, s, one_kernel=True)
    y2, final2, window2 = kernel(qkv, a, b, cs, s, one_kernel=False)
    y3, kept1, _ = kernel(qkv, a, b, cs, s, capture=True, one_kernel=True)
    y4, kept2, _ = kernel(qkv, a, b, cs, s, capture=True, one_kernel=False)
    r["paths_equal"] = (same(y1, y2) and same(final1, final2) and same(window1, window2) and same(y3, y4)
                        and same(kept1, kept2) and same(kept1[:, -1], final1))
    # chunks: 1 + 7 + 25 positions (the last over the two kernels), each from the last's states, against the 33 at once
    ys, win, st, at = [], cs, s, 0
    for n in (1, 7, 25):
        part = slice(at, at + n)
        o, st, win = kernel(qkv[:, part], a[:, part], b[:, part], win, st)
        ys.append(o)
        at += n
    r["chunks_equal"] = same(mx.concatenate(ys, axis=1), y) and same(win, window) and same(st, final)
    # batch: the two rows together against each alone
    alone = [kernel(qkv[i:i + 1], a[i:i + 1], b[i:i + 1], cs[i:i + 1], s[i:i + 1]) for i in range(2)]
    r["batch_equal"] = all(same(y[i:i + 1], o) and same(final[i:i + 1], f) and same(window[i:i + 1], w)
                           for i, (o, f, w) in enumerate(alone))
    # the verify: three positions with every state kept, against three one-token steps
    c_y, c_states, c_win = kernel(qkv[:, :3], a[:, :3], b[:, :3], cs, s, capture=True)
    win, st, ok = cs, s, True
    for t in range(3):
        o, st, win = kernel(qkv[:, t:t + 1], a[:, t:t + 1], b[:, t:t + 1], win, st)
        ok = ok and same(o, c_y[:, t:t + 1]) and same(st, c_states[:, t])
    r["capture_equal"] = ok and same(c_win, win)
    r["layer_ms"] = timings(lin, data)
    return r


def timings(lin, data) -> list[dict]:
    """Milliseconds a call of the layer's core (projections to output projection), the ops against the kernels, and
    for a prompt chunk the one kernel forced (its positions in turn)."""
    rows = []
    for B, T in ((1, 1), (8, 1), (1, 2), (1, 2048)):
        x, cs, s = data(B, T)
        ways = {"ops": lambda: core(lin, x, cs, s, fused=False), "kernels": lambda: core(lin, x, cs, s)}
        if T > fused_layer.ONE_KERNEL_POSITIONS:
            def forced():
                limit = fused_layer.ONE_KERNEL_POSITIONS
                fused_layer.ONE_KERNEL_POSITIONS = T
                try:
                    return core(lin, x, cs, s)
                finally:
                    fused_layer.ONE_KERNEL_POSITIONS = limit
            ways["one_kernel"] = forced
        row: dict = {"B": B, "T": T}
        for name, fn in ways.items():
            fn()
            times = []
            for _ in range(5):
                tic = time.perf_counter()
                for _ in range(10):
                    fn()
                times.append((time.perf_counter() - tic) / 10)
            row[name] = round(1e3 * sorted(times)[2], 4)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen35-2b,qwen35-9b")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if kind() != "cuda":
        print("layer_check: needs MLX's CUDA backend")
        return 2
    results = [check(s) for s in a.shapes.split(",")]
    for r in results:
        print(json.dumps(r))
    if a.out:
        a.out.write_text(json.dumps({"benchmark": "layer_check", "results": results}, indent=2))
    ok = all(r["paths_equal"] and r["chunks_equal"] and r["batch_equal"] and r["capture_equal"]
             and r["against_ops"]["window_equal"]
             for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
