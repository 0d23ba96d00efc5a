#!/usr/bin/env python3
"""The gated-delta conv's one-kernel step (``causal_conv.conv_step``: the conv over [state; x] and the next window)
against the concatenation, the conv kernel and the slice it replaces, on MLX's CUDA backend: bitwise equal outputs
and windows (the same products summed in the same order) for batch sizes, step lengths, dtypes, and x a column slice
of a wider array (as the fused projection gives it). Writes a JSON result; on a machine without CUDA it says so."""

from __future__ import annotations

import itertools
import sys

import mlx.core as mx
import mlx.nn as nn
from bitwise_report import output_path, report

from vllm_mlx_mtp_routing.model.kernels import causal_conv
from vllm_mlx_mtp_routing.model.kernels.device import kind

C_2B = 6144  # Qwen3.5-2B's conv channels: 2 x 16 key heads x 128 + 16 value heads x 128


def case(B: int, S: int, C: int, dtype: mx.Dtype, sliced: bool, seed: int) -> dict:
    mx.random.seed(seed)
    conv = nn.Conv1d(C, C, kernel_size=4, groups=C, padding=0, bias=False)
    conv.weight = conv.weight.astype(dtype)
    conv.train(False)  # as the model runs it (a conv in training keeps the module's own)
    state = mx.random.normal((B, 3, C)).astype(dtype)
    wide = mx.random.normal((B, S, C + 96)).astype(dtype)
    x = wide[..., 32 : 32 + C] if sliced else mx.contiguous(wide[..., :C])
    window = mx.concatenate([state, x], axis=1)
    want_y, want_w = causal_conv.conv1d(conv, window), window[:, -3:, :]
    causal_conv.conv_step_devices.add(kind())
    try:
        ran = causal_conv.step_runs(conv, state, S)
        got_y, got_w = causal_conv.conv_step(conv, state, x)
        mx.eval(want_y, want_w, got_y, got_w)
    finally:
        causal_conv.conv_step_devices.discard(kind())
    return {"B": B, "S": S, "C": C, "dtype": str(dtype), "x_sliced": sliced, "kernel_ran": ran,
            "output_equal": bool(mx.array_equal(want_y, got_y).item()),
            "window_equal": bool(mx.array_equal(want_w, got_w).item())}


def main(argv: list[str] | None = None) -> int:
    out = output_path("conv_step", __doc__, argv)
    if out is None:
        return 0
    grid = itertools.product((1, 3, 8), (1, 2, 5, 64), (64, C_2B), (mx.bfloat16, mx.float32), (False, True))
    rows = [case(B, S, C, dtype, sliced, seed=i) for i, (B, S, C, dtype, sliced) in enumerate(grid)]
    return report("conv_step", rows, ("kernel_ran", "output_equal", "window_equal"), out)


if __name__ == "__main__":
    sys.exit(main())
