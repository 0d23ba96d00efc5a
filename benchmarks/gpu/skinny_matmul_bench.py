#!/usr/bin/env python3
"""The few-row matmul kernel (vllm_mlx_mtp_routing/model/kernels/skinny_matmul.py) against MLX's own, on a GPU.

1. exactness: every Qwen3.5-2B linear shape, rows 1..8, bf16: error against an fp32 reference
   (and MLX's own error beside it), and whether each row's result is bitwise the same computed
   alone and in any batch (the kernel's, and MLX's own GEMV-vs-GEMM);
2. matmul time: all of a 2B step's linear shapes (24 layers) in one eval, rows 1..8, MLX vs kernel,
   alternating per iteration;
3. the model: the 2B-shaped text model (random bf16, built in memory as mtp_shapes_bench builds it)
   with a 128-token context: a decode step t1 and a 2-token verify without capture t2, batch 1/2/4/8,
   MLX's Linear vs the kernel's, alternating per iteration (medians and the median paired ratio).

  python benchmarks/gpu/skinny_matmul_bench.py --out $OUT/skinny_matmul_gpu.json          # GPU
  python benchmarks/gpu/skinny_matmul_bench.py --small --out /tmp/skinny.json             # CPU: logic only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from lib.provenance import commit, device, versions  # noqa: E402

from vllm_mlx_mtp_routing.model.kernels import skinny_matmul  # noqa: E402
from vllm_mlx_mtp_routing.model.kernels.device import on_cuda  # noqa: E402

# (N, K) of a Qwen3.5-2B layer's linears: GDN in_proj_qkv, z, b/a, out; attention q (with gate), k/v, o; MLP
SHAPES_2B = [(6144, 2048), (2048, 2048), (16, 2048), (2048, 2048), (4096, 2048), (512, 2048), (2048, 2048),
             (6144, 2048), (6144, 2048), (2048, 6144)]  # fmt: skip


def exactness(shapes: list[tuple[int, int]], rows: list[int]) -> list[dict]:
    """Error against fp32 for MLX and the kernel (called directly, any M), and whether the first
    rows' results are bitwise the same as computed in the smallest batch (the kernel: MIN_ROWS)."""
    out = []
    lo = skinny_matmul.MIN_ROWS
    on_gpu = on_cuda()
    for N, K in shapes:
        w = (mx.random.normal((N, K)) * K**-0.5).astype(mx.bfloat16)
        x = mx.random.normal((max(rows), K)).astype(mx.bfloat16)
        ref = x.astype(mx.float32) @ w.astype(mx.float32).T
        small_k = skinny_matmul.skinny_matmul(x[:lo], w) if on_gpu else None
        small_m = x[:lo] @ w.T
        alone_m = x[:1] @ w.T
        for M in rows:
            m = x[:M] @ w.T
            scale = mx.abs(ref[:M]).max()
            row = {"N": N, "K": K, "rows": M,
                   "mlx_max_err": (mx.abs(m.astype(mx.float32) - ref[:M]).max() / scale).item(),
                   "mlx_row0_same_as_alone": bool(mx.array_equal(m[:1], alone_m).item())}
            if M >= lo:
                row["mlx_rows_same_as_smallest_batch"] = bool(mx.array_equal(m[:lo], small_m).item())
            if on_gpu:
                k = skinny_matmul.skinny_matmul(x[:M], w)
                row["kernel_max_err"] = (mx.abs(k.astype(mx.float32) - ref[:M]).max() / scale).item()
                if M >= lo:
                    row["kernel_rows_same_as_smallest_batch"] = bool(mx.array_equal(k[:lo], small_k).item())
            out.append(row)
    return out


def paired(fns: dict, iters: int) -> dict:
    """Median ms of each fn, the calls alternating within each iteration; ratios against the first."""
    names = list(fns)
    for f in fns.values():
        f()
        f()
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(iters):
        for n in names:
            tic = time.perf_counter()
            fns[n]()
            times[n].append(1000 * (time.perf_counter() - tic))
    res = {f"{n}_ms": round(statistics.median(t), 4) for n, t in times.items()}
    for n in names[1:]:
        res[f"{n}_over_{names[0]}"] = round(statistics.median(b / a for a, b in zip(times[names[0]], times[n])), 3)
    return res


def matmul_time(shapes: list[tuple[int, int]], layers: int, rows: list[int], iters: int) -> list[dict]:
    ws = [(mx.random.normal((N, K)) * K**-0.5).astype(mx.bfloat16) for _ in range(layers) for N, K in shapes]
    mx.eval(ws)
    out = []
    for M in rows:
        xs = {K: mx.random.normal((M, K)).astype(mx.bfloat16) for _, K in shapes}
        mx.eval(list(xs.values()))
        res = paired({
            "mlx": lambda: mx.eval([xs[w.shape[1]] @ w.T for w in ws]),
            "kernel": lambda: mx.eval([skinny_matmul.skinny_matmul(xs[w.shape[1]], w) for w in ws]),
        }, iters)
        gb = sum(w.nbytes for w in ws) / 1e9
        res.update({"rows": M, "weight_gb": round(gb, 3),
                    "mlx_gb_s": round(gb / res["mlx_ms"] * 1000, 1), "kernel_gb_s": round(gb / res["kernel_ms"] * 1000, 1)})
        out.append(res)
        print(json.dumps(res), flush=True)
    return out


def model_steps(shape_name: str, batches: list[int], iters: int) -> list[dict]:
    from mlx_lm.models.cache import KVCache  # noqa: F401  (the model's caches come from make_cache)

    import mtp_shapes_bench as msb
    from vllm_mlx_mtp_routing.model.backbone import backbone_forward

    tok, size, special = msb.load_tokenizer()
    shape = msb.SHAPES[shape_name]
    model, head, _, _ = msb.build(shape, mx.bfloat16, sorted(set(range(size, shape["vocab_size"])) | set(special)))
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]

    def use(kernel: bool) -> None:
        for m in linears:
            m.__class__ = skinny_matmul.SkinnyLinear if kernel else nn.Linear

    out = []
    for B in batches:
        prompt = mx.random.randint(10, 3900, (B, 128)).astype(mx.uint32)
        cache = model.make_cache()
        mx.eval(model(prompt, cache=cache))
        saved = [list(c.state) if not hasattr(c, "offset") else (c.keys, c.values, c.offset) for c in cache]
        x1 = prompt[:, -1:]
        x2 = prompt[:, -2:]

        def rewind() -> None:
            for c, s in zip(cache, saved):
                if isinstance(s, tuple):
                    c.keys, c.values, c.offset = s
                else:
                    c.state = list(s)

        def step(x: mx.array, kernel: bool):
            def fn() -> None:
                use(kernel)
                logits, _, _ = backbone_forward(model, x, cache)
                mx.eval(mx.argmax(logits[:, -1], axis=-1), [c.state for c in cache])
                rewind()
            return fn

        res = paired({"t1_mlx": step(x1, False), "t1_kernel": step(x1, True),
                      "t2_mlx": step(x2, False), "t2_kernel": step(x2, True)}, iters)
        use(False)
        res["batch"] = B
        res["t2_over_t1_mlx"] = round(res["t2_mlx_ms"] / res["t1_mlx_ms"], 3)
        res["t2_over_t1_kernel"] = round(res["t2_kernel_ms"] / res["t1_kernel_ms"], 3)
        out.append(res)
        print(json.dumps(res), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the script's logic)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    shapes = [(64, 64), (16, 128)] if a.small else SHAPES_2B
    rows = list(range(1, skinny_matmul.MAX_ROWS + 1))
    result = {"benchmark": "skinny_matmul_bench", "commit": commit(), "device": device(), "versions": versions(),
              "kernel_available": on_cuda()}
    result["exactness"] = exactness(shapes, rows)
    print(json.dumps({"exactness_worst_kernel": max((r.get("kernel_max_err", 0) for r in result["exactness"])),
                      "exactness_worst_mlx": max(r["mlx_max_err"] for r in result["exactness"]),
                      "kernel_rows_batch_invariant_2_8": all(r.get("kernel_rows_same_as_smallest_batch", True)
                                                             for r in result["exactness"]),
                      "mlx_rows_batch_invariant_2_8": all(r.get("mlx_rows_same_as_smallest_batch", True)
                                                          for r in result["exactness"]),
                      "mlx_row_alone_same_as_batched": all(r["mlx_row0_same_as_alone"] for r in result["exactness"])}),
          flush=True)
    if result["kernel_available"]:
        result["matmul"] = matmul_time(shapes, 2 if a.small else 24, rows, a.iters)
        result["model"] = model_steps("small" if a.small else "2b", [int(b) for b in a.batches.split(",")], a.iters)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
