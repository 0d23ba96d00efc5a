#!/usr/bin/env python3
"""A Qwen3.5-2B-shaped VLM checkpoint with random bf16 weights, drawn on MLX's default device.

The project's builder (`support.tiny_model.build_tiny_qwen35_vlm`) writes
everything: config, processor configs, chat template, tokenizer (copied from the trained tiny
model), the tiny vision tower and the MTP head in `mtp/weights.safetensors`, with its key layout.
Only its random source is swapped: it draws with numpy in float32 on one CPU core, about a minute
for 2.4 B values; `mx.random` on a GPU draws them in bf16 in well under a second.

Shape: hidden 2048, 24 layers ([GDN x3, attention] x6), MLP 6144, 8 / 2 attention heads of 256,
GDN 16 / 16 heads of 128, vocab 248320, one MTP layer; the same text shape as step_costs.py's
`qwen35-2b` preset. The builder writes an untied lm_head (Qwen3.5-2B ties it): 0.51 B more
parameters on disk and in memory, the same bytes read per decode step. lm_head rows of ids the
tokenizer lacks (and of special tokens) are zero, so greedy decoding stays inside the tokenizer
and never stops early.

  python benchmarks/lib/make_qwen35_2b.py /tmp/qwen35-2b          # ~5 GB on disk
  python benchmarks/lib/make_qwen35_2b.py /tmp/small --small      # same path, tiny shape (CPU check)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*
sys.path.insert(0, str(REPO / "benchmarks"))
from lib.report import mark_random  # noqa: E402
TRAINED = REPO / "models" / "tiny-qwen35-trained"

SHAPE_2B = {
    "hidden_size": 2048, "intermediate_size": 6144, "num_layers": 24, "full_attention_interval": 4,
    "num_heads": 8, "num_kv_heads": 2, "head_dim": 256, "linear_key_heads": 16, "linear_value_heads": 16,
    "linear_head_dim": 128, "vocab_size": 248320, "mtp_layers": 1,
}  # fmt: skip
SHAPE_SMALL = {**SHAPE_2B, "hidden_size": 128, "intermediate_size": 256, "num_layers": 4, "head_dim": 64,
               "linear_key_heads": 2, "linear_value_heads": 4, "linear_head_dim": 32, "vocab_size": 8192}  # fmt: skip


class DeviceInit:
    """Stands in for tiny_model._Init (same methods) drawing bf16 with mx.random on the default device."""

    def __init__(self, seed: int) -> None:
        import mlx.core as mx

        self.mx = mx
        self.key = mx.random.key(seed)
        self.rng = np.random.default_rng(seed)  # the builder draws A_log from it (a few values)

    def normal(self, shape, std: float):
        mx = self.mx
        self.key, k = mx.random.split(self.key)
        return mx.random.normal(tuple(shape), dtype=mx.bfloat16, key=k) * std

    def linear(self, out_f: int, in_f: int):
        return self.normal((out_f, in_f), 1.0 / math.sqrt(in_f))

    def norm(self, n: int):
        return 1.0 + self.normal((n,), 0.02)

    def bias(self, n: int):
        return self.normal((n,), 0.02)


def build(out: Path, shape: dict, seed: int = 0, tokenizer_from: Path = TRAINED) -> dict:
    from support import tiny_model

    # Reaches into the builder's private random source (project-internal, tiny_model as of 0.1.0):
    # build_tiny_qwen35_vlm looks `_Init` up at call time, and every tensor it writes comes from it.
    with mock.patch.object(tiny_model, "_Init", DeviceInit):
        info = tiny_model.build_tiny_qwen35_vlm(out, dtype="bfloat16", seed=seed, tokenizer_from=tokenizer_from,
                                                force=True, **shape)
    info.pop("zero_logit_ids", None)
    mark_random(out)  # the benchmarks that serve it say its acceptance and text mean nothing
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--small", action="store_true", help="tiny shape through the same code (a CPU check)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", type=Path, default=TRAINED)
    a = ap.parse_args(argv)
    import mlx.core as mx

    t0 = time.perf_counter()
    info = build(a.out, SHAPE_SMALL if a.small else SHAPE_2B, a.seed, a.tokenizer_from)
    info["build_s"] = round(time.perf_counter() - t0, 2)
    info["device"] = str(mx.default_device())
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
