#!/usr/bin/env python3
"""A copy of a model folder with its half-precision weights in fp32 (the MTP head's subfolder too), for CPU runs whose
matmuls should go through BLAS (cpu_openblas.sh): MLX's CPU backend sends only fp32 gemms there.

  python benchmarks/lib/fp32_model.py models/tiny-qwen35-trained /tmp/tiny-fp32
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def fp32_copy(src: Path, dst: Path) -> Path:
    import mlx.core as mx

    shutil.copytree(src, dst, dirs_exist_ok=True)
    for f in dst.rglob("*.safetensors"):
        weights, meta = mx.load(str(f), return_metadata=True)
        weights = {k: v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) else v for k, v in weights.items()}
        mx.save_safetensors(str(f), weights, metadata=meta)
    config = dst / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text().replace('"bfloat16"', '"float32"')
                                            .replace('"float16"', '"float32"')), indent=2))
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: fp32_model.py SRC DST")
    print(fp32_copy(Path(sys.argv[1]), Path(sys.argv[2])))
