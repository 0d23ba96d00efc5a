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

from .device import kind, on_cuda

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

# The conv of a step and its new window in one kernel (``conv_step``): the window [state; x] is read where it lies,
# not concatenated first, and its last K - 1 positions are written out as the next state.
_STEP_SOURCE = """
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int C = x_shape[2];
    const int S = x_shape[1];
    const int P = state_shape[1];
    const int T = S > P ? S : P;
    if (idx >= (size_t)x_shape[0] * T * C) return;
    const int c = idx % C;
    const size_t bt = idx / C;
    const int t = bt % T;
    const size_t b = bt / T;
    // inputs as they lie (x is a column slice of the fused projection): element strides, no copy first
    #define AT(i) ((i) < P ? state[b * state_strides[0] + (size_t)(i) * state_strides[1] + c * state_strides[2]] \
                           : x[b * x_strides[0] + (size_t)((i) - P) * x_strides[1] + c * x_strides[2]])
    if (t < S) {
        float acc = 0.0f;
        #pragma unroll
        for (int j = 0; j < K; ++j)
            acc += static_cast<float>(AT(t + j)) * static_cast<float>(w[c * w_strides[0] + j * w_strides[1]]);
        y[(b * S + t) * C + c] = static_cast<DT>(acc);
    }
    if (t < P) window[(b * P + t) * C + c] = AT(S + t);
    #undef AT
"""
# Where ``conv_step`` runs its one kernel: CUDA, where it was measured (benchmarks/decode_variants.py --options
# conv_step; its exactness: benchmarks/gpu/conv_step_check.py). Elsewhere it concatenates, as before.
conv_step_devices: set[str] = {"cuda"}


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="depthwise_causal_conv", input_names=["x", "w"], output_names=["y"], source=_SOURCE)


@cache
def _step_kernel() -> Any:
    return mx.fast.cuda_kernel(name="depthwise_causal_conv_step", input_names=["state", "x", "w"],
                               output_names=["y", "window"], source=_STEP_SOURCE, ensure_row_contiguous=False)


def supported(conv: nn.Module, x: mx.array) -> TypeGuard[nn.Conv1d]:
    """Whether ``conv(x)`` runs the kernel here: a CUDA device, a depthwise ``nn.Conv1d`` without padding, stride or
    dilation, ``x`` [B, T, C] in the weights' dtype."""
    return _fits(conv, tuple(x.shape), x.dtype)


def _fits(conv: nn.Module, shape: tuple[int, ...], dtype: mx.Dtype) -> TypeGuard[nn.Conv1d]:
    w = getattr(conv, "weight", None)
    return (
        on_cuda()
        and isinstance(conv, nn.Conv1d)
        and not conv.training
        and w is not None
        and len(shape) == 3
        and w.shape == (shape[2], w.shape[1], 1)
        and shape[1] >= w.shape[1]
        and conv.padding == 0
        and conv.stride == 1
        and conv.dilation == 1
        and dtype == w.dtype
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


def step_runs(conv: nn.Module, state: mx.array, steps: int) -> bool:
    """Whether ``conv_step`` over ``state`` and ``steps`` new positions runs its one kernel here: on
    (``conv_step_devices``), a supported conv, a state [B, K - 1, C] in the weights' dtype."""
    w = getattr(conv, "weight", None)
    if kind() not in conv_step_devices or w is None or state.ndim != 3 or state.shape[1] != w.shape[1] - 1:
        return False
    B, P, C = state.shape
    return _fits(conv, (B, P + steps, C), state.dtype)


def conv_step(conv: nn.Module, state: mx.array, x: mx.array) -> tuple[mx.array, mx.array]:
    """``conv`` over the window [state; x] -> (its output [B, S, C], the window's last K - 1 positions: the next state).
    One kernel where it is on (``conv_step_devices``) and runs (``supported``); the same arithmetic as the
    concatenation and ``conv1d``, so the same values."""
    K = conv.weight.shape[1]
    if not step_runs(conv, state, x.shape[1]) or x.shape[0] != state.shape[0] or x.dtype != state.dtype:
        window = mx.concatenate([state, x], axis=1)
        return conv1d(conv, window), window[:, -(K - 1):, :]
    B, S, C = x.shape
    n = B * max(S, K - 1) * C
    y, last = _step_kernel()(
        inputs=[state, x, conv.weight],
        template=[("DT", x.dtype), ("K", K)],
        grid=((n + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, S, C), (B, K - 1, C)],
        output_dtypes=[x.dtype, x.dtype],
    )
    return (y + conv.bias if "bias" in conv else y), last
