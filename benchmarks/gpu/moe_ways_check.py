#!/usr/bin/env python3
"""The MoE switch's three dispatch ways (model/kernels/moe_dispatch.py) on a GPU, at a MoE shape's decode sizes:
whether the expert kernel (expert_gemv.py, each expert's weights read once) gives the gather's bits, with the gate and
up experts fused and apart (it should: each pair is the same sum); how far mlx-lm's grouped sort lies from them; and
what each way costs over ``--layers`` MoE blocks in one graph (the step's shape), alternated, median of ``--rounds``.
Writes a JSON result; run on a CUDA machine.

  python benchmarks/gpu/moe_ways_check.py --shape qwen35-35b-a3b --out moe_ways.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from lib.random_model import build, text_config  # noqa: E402
from lib.shapes import PRESETS  # noqa: E402

from vllm_mlx_mtp_routing.model.kernels import expert_gemv, fused_projections, moe_dispatch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen35-35b-a3b")
    ap.add_argument("--layers", type=int, default=8, help="MoE blocks built and called in one graph")
    ap.add_argument("--tokens", default="1,4,8,12,16,24,32,48")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rows", default="", help="also time the expert kernel at these rows a warp, wide:narrow K "
                    "(e.g. 2:4,8:16)")
    ap.add_argument("--dtype", default="bfloat16", help="float32 on MLX's CPU backend (its GatherMM's only type)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)

    dtype = getattr(mx, a.dtype)
    model, _ = build(text_config(PRESETS[a.shape], a.layers), dtype, [])
    blocks = [layer.mlp for layer in model.model.layers]
    H, k = model.args.hidden_size, blocks[0].top_k
    rows = []
    for n in [int(t) for t in a.tokens.split(",")]:
        x = mx.random.normal((n, H), key=mx.random.key(7 + n)).astype(dtype)
        routed = [mx.argpartition(b.gate(x), kth=-k, axis=-1)[..., -k:] for b in blocks]
        mx.eval(x, routed)
        outs = {w: [b.switch_mlp.dispatch(x, r, w) for b, r in zip(blocks, routed)] for w in moe_dispatch.WAYS}
        made = fused_projections.detach(model)  # the gate and up experts apart: the kernel's one-set calls
        unfused = [b.switch_mlp.dispatch(x, r, moe_dispatch.BY_EXPERT) for b, r in zip(blocks, routed)]
        mx.eval(outs, unfused)
        fused_projections.attach(made)
        gather = outs[moe_dispatch.GATHER]
        # each side: (way, the expert kernel's rows a warp by K), all alternated in every round
        default_rows = dict(expert_gemv.ROWS)
        sides = {w: (w, default_rows) for w in moe_dispatch.WAYS}
        for variant in [v for v in a.rows.split(",") if v]:
            wide, narrow = (int(r) for r in variant.split(":"))
            sides[f"by_expert_rows_{variant}"] = (moe_dispatch.BY_EXPERT, {1024: wide, 0: narrow})
        times: dict[str, list[float]] = {name: [] for name in sides}
        try:
            for r in range(a.rounds + 1):  # round 0 compiles each variant's kernel, untimed
                for name, (way, table) in sides.items():
                    expert_gemv.ROWS.clear()
                    expert_gemv.ROWS.update(table)
                    t = time.perf_counter()
                    mx.eval([b.switch_mlp.dispatch(x, inds, way) for b, inds in zip(blocks, routed)])
                    if r:
                        times[name].append(1000 * (time.perf_counter() - t))
        finally:
            expert_gemv.ROWS.clear()
            expert_gemv.ROWS.update(default_rows)
        distinct = statistics.mean(len(set(r.flatten().tolist())) for r in routed)
        row = {
            "tokens": n, "pairs": n * k, "distinct_experts_per_layer": round(distinct, 1),
            "by_expert_bitwise_gather": all(mx.array_equal(g, o).item()
                                            for g, o in zip(gather, outs[moe_dispatch.BY_EXPERT])),
            "by_expert_unfused_bitwise_gather": all(mx.array_equal(g, o).item() for g, o in zip(gather, unfused)),
            "sorted_max_abs_diff": max(mx.abs(g.astype(mx.float32) - o.astype(mx.float32)).max().item()
                                       for g, o in zip(gather, outs[moe_dispatch.SORTED])),
            "ms_median": {w: round(statistics.median(v), 3) for w, v in times.items()},
        }
        row["by_expert_over_gather"] = round(row["ms_median"][moe_dispatch.BY_EXPERT]
                                             / row["ms_median"][moe_dispatch.GATHER], 3)
        rows.append(row)
        print("moe_ways: " + json.dumps(row), flush=True)
    result = {"benchmark": "moe_ways_check", "shape": a.shape, "layers": a.layers, "device": str(mx.default_device()),
              "rounds": a.rounds, "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    return 0 if all(r["by_expert_bitwise_gather"] and r["by_expert_unfused_bitwise_gather"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
