"""Which backend MLX's default device runs on: the one device check of the package.

Read at each call, never at import: a caller may change MLX's default device (``mx.set_default_device``) after
the package is imported. Which GPU backend the MLX build has does not change within a process, so that is asked
once.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import mlx.core as mx

Kind = Literal["cpu", "metal", "cuda"]


@lru_cache(maxsize=1)
def _gpu_backend() -> Kind:
    # MLX's GPU backends are Metal and CUDA.
    return "metal" if mx.metal.is_available() else "cuda"


def kind() -> Kind:
    """Where MLX's default device runs now: the CPU, a Metal GPU or a CUDA GPU."""
    return "cpu" if mx.default_device().type != mx.gpu else _gpu_backend()


def on_cuda() -> bool:
    """MLX's default device is a CUDA GPU: the package's CUDA kernels run."""
    return kind() == "cuda"


def on_metal() -> bool:
    """MLX's default device is a Metal GPU: mlx-lm's Metal kernels run."""
    return kind() == "metal"


def on_gpu() -> bool:
    """MLX's default device is a GPU, Metal or CUDA."""
    return kind() != "cpu"
