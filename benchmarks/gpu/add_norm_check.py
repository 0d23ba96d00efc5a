#!/usr/bin/env python3
"""The residual add and its RMS norm in one kernel (``add_norm.add_norm``) against MLX's own add and ``rms_norm`` on
MLX's CUDA backend: the sum and the norm bitwise equal for row counts, row lengths (each of MLX's small-row launch
shapes, and lengths that are not a whole number of vector loads) and dtypes. Writes a JSON result; on a machine
without CUDA it says so."""

from __future__ import annotations

import itertools
import sys

import mlx.core as mx
import mlx.nn as nn
from bitwise_report import output_path, report

from vllm_mlx_mtp_routing.model.kernels import add_norm as an
from vllm_mlx_mtp_routing.model.kernels.device import kind


def case(rows: int, D: int, dtype: mx.Dtype, seed: int) -> dict:
    mx.random.seed(seed)
    norm = nn.RMSNorm(D, eps=1e-6)
    norm.weight = (1.0 + 0.1 * mx.random.normal((D,))).astype(dtype)
    x = (4.0 * mx.random.normal((rows, 1, D))).astype(dtype)  # a residual stream larger than the update
    r = mx.random.normal((rows, 1, D)).astype(dtype)
    want_h = x + r
    want_y = norm(want_h)
    an.add_norm_devices.add(kind())
    try:
        ran = an.runs(x, norm)
        got_h, got_y = an.add_norm(x, r, norm)
        mx.eval(want_h, want_y, got_h, got_y)
    finally:
        an.add_norm_devices.discard(kind())
    return {"rows": rows, "D": D, "dtype": str(dtype), "launch": an.launch_shape(D, dtype), "kernel_ran": ran,
            "sum_equal": bool(mx.array_equal(want_h, got_h).item()),
            "norm_equal": bool(mx.array_equal(want_y, got_y).item()),
            "norm_max_abs_diff": float(mx.max(mx.abs(want_y.astype(mx.float32) - got_y.astype(mx.float32))).item())}


def main(argv: list[str] | None = None) -> int:
    out = output_path("add_norm", __doc__, argv)
    if out is None:
        return 0
    grid = itertools.product((1, 3, 8, 17), (64, 100, 576, 1024, 2048, 4096, 5120, 8192),
                             (mx.bfloat16, mx.float16, mx.float32))
    rows = [case(n, D, dtype, seed=i) for i, (n, D, dtype) in enumerate(grid) if an.launch_shape(D, dtype) is not None]
    return report("add_norm", rows, ("kernel_ran", "sum_equal", "norm_equal"), out)


if __name__ == "__main__":
    sys.exit(main())
