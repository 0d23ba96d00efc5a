"""The gated-delta layer's depthwise causal conv on MLX's CUDA backend: one kernel for every shape.

MLX runs ``nn.Conv1d`` on CUDA through cuDNN, which plans every new input shape: a stall of every running stream at
each new batch size and each time a prompt's last chunk has a length not seen before. The layer's conv is depthwise (one
input channel per output) with no padding: each output is ``K`` products of one channel, summed here in float32 by
one thread, in the same order whatever the shape, so a position's result does not depend on the chunk or the batch
it is computed in. Written as shifted products in MLX ops the same sum runs unfused, an op per product and sum; this
kernel is compiled once per dtype and kernel size.
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypeGuard

import mlx.core as mx
import mlx.nn as nn

from .device import on_cuda

_SOURCE = """
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int C = x_shape[2];
    const int T_in = x_shape[1];
    const int T_out = T_in - K + 1;
    if (idx >= (size_t)x_shape[0] * T_out * C) return;
    const int c = idx % C;
    const size_t bt = idx / C;
    const size_t t = bt % T_out;
    const size_t b = bt / T_out;
    const DT* x_ = x + (b * T_in + t) * C + c;
    float acc = 0.0f;
    #pragma unroll
    for (int j = 0; j < K; ++j) acc += static_cast<float>(x_[(size_t)j * C]) * static_cast<float>(w[c * K + j]);
    y[idx] = static_cast<DT>(acc);
"""
THREADS = 256


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="depthwise_causal_conv", input_names=["x", "w"], output_names=["y"], source=_SOURCE)


def supported(conv: nn.Module, x: mx.array) -> TypeGuard[nn.Conv1d]:
    """Whether ``conv(x)`` runs the kernel here: a CUDA device, a depthwise ``nn.Conv1d`` without padding, stride or
    dilation, ``x`` [B, T, C] in the weights' dtype."""
    w = getattr(conv, "weight", None)
    return (
        on_cuda()
        and isinstance(conv, nn.Conv1d)
        and not conv.training
        and w is not None
        and x.ndim == 3
        and w.shape == (x.shape[2], w.shape[1], 1)
        and x.shape[1] >= w.shape[1]
        and conv.padding == 0
        and conv.stride == 1
        and conv.dilation == 1
        and x.dtype == w.dtype
    )


def depthwise_causal_conv(conv: nn.Conv1d, x: mx.array) -> mx.array:
    """``conv(x)`` for a depthwise ``nn.Conv1d`` (see ``supported``): x [B, T, C] -> [B, T - K + 1, C]."""
    B, T, C = x.shape
    K = conv.weight.shape[1]
    n = B * (T - K + 1) * C
    (y,) = _kernel()(
        inputs=[x, conv.weight],
        template=[("DT", x.dtype), ("K", K)],
        grid=((n + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, T - K + 1, C)],
        output_dtypes=[x.dtype],
    )
    return y + conv.bias if "bias" in conv else y


def conv1d(conv: nn.Module, x: mx.array) -> mx.array:
    """``conv(x)``: through the kernel where it runs (``supported``), else the module itself."""
    return depthwise_causal_conv(conv, x) if supported(conv, x) else conv(x)
