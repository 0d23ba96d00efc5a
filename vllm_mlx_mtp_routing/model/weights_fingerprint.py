"""A short id of a model's weights: what the prefix cache's disk tier names its folder by and the prefill calibration
file keys its entries by, so files of one model are never read for another."""

from __future__ import annotations

import hashlib
from typing import Any, cast

import mlx.core as mx


def fingerprint(model: Any) -> str:
    """A short id of the model's weights: parameter names, shapes and dtypes, and sums over the first
    values of a few tensors (not whole ones: a float32 copy of a large vocabulary's embedding would be
    gigabytes), so two checkpoints of one shape do not share files."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    for name, v in params:
        h.update(f"{name}:{v.shape}:{v.dtype};".encode())
    for _, v in params[:: max(1, len(params) // 8)]:
        h.update(f"{mx.sum(v.reshape(-1)[:65536].astype(mx.float32)).item():.9e};".encode())
    return h.hexdigest()[:16]
