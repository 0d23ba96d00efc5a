"""Why a verify step costs what it does on a platform: matmul time against the number of rows M.

Speculative decoding pays where a decode step is bound by reading the weights (time flat in M):
verifying k+1 tokens per row then costs about one step. Where the matmul is bound by arithmetic
(time proportional to M), a verify of 2 tokens per row costs about two steps and MTP cannot pay at
any acceptance. Times x @ W.T for the tiny trained model's MLP shape (256 -> 768) and Qwen3.5-2B's
(2048 -> 6144), M = 1..64 rows, each ending in mx.eval (median of --iters).
With --stack N, N distinct weight matrices are multiplied in one eval (as a decode step's layers are),
so on a GPU the weights stream from memory rather than sit in cache and launches overlap: the time a
step's matmuls take at M rows (a [B, 2] verify is M = 2B).

  python benchmarks/matmul_scaling.py --out benchmarks/results/matmul_scaling_cpu.json
  python benchmarks/matmul_scaling.py --stack 72 --dtypes bfloat16 --rows 1,2,3,4,8,16 --out $OUT/matmul_stack_gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

SHAPES = {"tiny": (256, 768), "qwen35-2b": (2048, 6144)}


def time_matmul(m: int, d_in: int, d_out: int, dtype: mx.Dtype, iters: int, stack: int = 1) -> float:
    x = mx.random.normal((m, d_in)).astype(dtype)
    ws = [mx.random.normal((d_out, d_in)).astype(dtype) for _ in range(stack)]
    mx.eval(x, ws)

    def run() -> None:
        mx.eval([x @ w.T for w in ws])

    for _ in range(5):
        run()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--stack", type=int, default=1, help="distinct weight matrices per timed eval")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    results = []
    for name, (d_in, d_out) in SHAPES.items():
        for dtype_name in a.dtypes.split(","):
            base = None
            for m in (int(r) for r in a.rows.split(",")):
                sec = time_matmul(m, d_in, d_out, getattr(mx, dtype_name), a.iters, a.stack)
                base = base or sec
                row = {"shape": name, "dtype": dtype_name, "rows": m, "stack": a.stack, "us": round(1e6 * sec, 1),
                       "vs_one_row": round(sec / base, 2),
                       "gflops": round(2 * m * d_in * d_out * a.stack / sec / 1e9, 2),
                       "weight_gb_s": round(d_in * d_out * a.stack * mx.zeros((), getattr(mx, dtype_name)).itemsize
                                            / sec / 1e9, 1)}
                results.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                                     "machine": f"{platform.machine()} {platform.system()}",
                                     "rows": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
