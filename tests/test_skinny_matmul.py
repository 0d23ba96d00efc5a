"""The few-row CUDA matmul (skinny_matmul.py) takes a text model's linear layers only on MLX's
CUDA backend and only for 2-8 rows of 2-byte floats; everywhere else a ``SkinnyLinear`` is
``nn.Linear``. On CPU that means bitwise the same outputs and no class swapped. The kernel's own
error and batch invariance are measured on a GPU by benchmarks/gpu/skinny_matmul_bench.py
(docs/benchmarks.md, "CUDA kernels")."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from vllm_mlx_mtp_routing.model.kernels.device import on_cuda
from vllm_mlx_mtp_routing.model.kernels.skinny_matmul import MAX_FEATURES, SkinnyLinear, supported
from vllm_mlx_mtp_routing.model.kernels.swaps import use_skinny_matmul


@pytest.mark.skipif(on_cuda(), reason="the CPU fallback; the kernel is checked on the GPU")
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_is_nn_linear_off_cuda(rows: int, bias: bool) -> None:
    mx.random.seed(rows)
    lin = nn.Linear(64, 48, bias=bias)
    lin.set_dtype(mx.bfloat16)
    x = mx.random.normal((rows, 1, 64)).astype(mx.bfloat16)
    expected = lin(x)
    lin.__class__ = SkinnyLinear
    assert mx.array_equal(lin(x), expected).item()


def test_supported_rules() -> None:
    w = mx.zeros((48, 64), mx.bfloat16)
    on = on_cuda()
    assert supported(mx.zeros((2, 64), mx.bfloat16), w) is on
    assert supported(mx.zeros((1, 1, 8, 64), mx.bfloat16), w) is on
    assert not supported(mx.zeros((1, 64), mx.bfloat16), w)  # one row: MLX's GEMV is faster
    assert not supported(mx.zeros((9, 64), mx.bfloat16), w)
    assert not supported(mx.zeros((2, 64), mx.float32), w.astype(mx.float32))
    assert not supported(mx.zeros((2, 60), mx.bfloat16), mx.zeros((48, 60), mx.bfloat16))  # 16-byte loads
    assert not supported(mx.zeros((2, 64), mx.bfloat16), mx.zeros((MAX_FEATURES + 8, 64), mx.bfloat16))


def test_text_model_layers_swapped_only_on_cuda(tiny) -> None:
    bundle, _ = tiny
    swapped = [m for _, m in bundle.model.named_modules() if isinstance(m, SkinnyLinear)]
    plain = [m for _, m in bundle.model.model.named_modules() if type(m) is nn.Linear]
    if on_cuda():
        assert swapped and not plain
    else:
        assert not swapped and plain
        assert use_skinny_matmul(bundle.model) == 0
