#!/usr/bin/env python3
"""Text-path prefill speed by gated-delta implementation: where does a prefill's time go off Metal?

mlx-lm 0.31.3 (and mlx-vlm's vendored copy) run the gated-delta recurrence as a Metal kernel on Apple
GPUs and, everywhere else (MLX CUDA, CPU), as a Python loop of ops per prompt token. This times one
prefill forward of N prompt tokens through the plugin's TextModel (zero-copy from the VLM) with

  loop     mlx-lm's own recurrence (what the text path runs today)
  chunked  training/chunked_gated_delta.py's chunked form (the same math in chunk-sized matmuls)

at batch 1 and 3 (three requests prefilled together share the loop's per-token launches), and
reports tokens/s and the chunked form's largest relative difference in the last position's logits.

  python benchmarks/prefill_gdn.py --model models/tiny-qwen35-trained --tokens 128,512
  python benchmarks/prefill_gdn.py --model /root/qwen35-2b --out $OUT/prefill_gdn_gpu.json     # GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "training"))

from vllm_mlx_mtp_routing.text_engine.prefill_budget import median_seconds  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: first-call compilation and allocation for this shape
    return median_seconds(fn, repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--batches", default="1,3")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    from chunked_gated_delta import patch_mlx_lm_qwen3_5
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    vlm, _ = load(str(a.model))
    model = build_text_model(vlm, a.model, json.loads((a.model / "config.json").read_text()), enable_mtp=False).model
    vocab = int(model.args.vocab_size)
    rows = []
    for n in (int(t) for t in a.tokens.split(",")):
        for b in (int(x) for x in a.batches.split(",")):
            ids = mx.random.randint(0, min(vocab, 4000), (b, n), key=mx.random.key(n + b))

            def forward() -> mx.array:
                out = model(ids, cache=model.make_cache())
                mx.eval(out)
                return out

            loop_s = timed(forward, a.repeats)
            ref = forward()[:, -1].astype(mx.float32)
            undo = patch_mlx_lm_qwen3_5(a.chunk)
            try:
                chunked_s = timed(forward, a.repeats)
                got = forward()[:, -1].astype(mx.float32)
            finally:
                undo()
            diff = (mx.abs(got - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-6)).item()
            row = {"tokens": n, "batch": b, "loop_s": round(loop_s, 4), "chunked_s": round(chunked_s, 4),
                   "loop_tok_s": round(b * n / loop_s, 1), "chunked_tok_s": round(b * n / chunked_s, 1),
                   "speedup": round(loop_s / chunked_s, 2), "last_logits_rel_diff": diff}
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"model": str(a.model), "device": str(mx.default_device()), "mlx": mx.__version__, "chunk": a.chunk,
              "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
