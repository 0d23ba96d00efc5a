"""Matmuls of 2-8 rows on MLX's CUDA backend: one kernel that reads each weight once.

A decode step multiplies B rows by every weight matrix; a verify of [token, draft] multiplies 2B.
MLX runs one row as a GEMV that streams the weights near the memory's bandwidth, and 2 or more rows
as a GEMM that streams them far slower at a decode step's shapes, flat in the row count: a batch of
2 costs nearly twice a batch of 1 in its matmuls, and a 2-token verify at batch 1 costs well over
a decode step, where both read the same weights once.

The kernel below is a GEMV generalized to M rows: a warp per output feature, 16-byte loads of the
weight row shared by the M input rows, fp32 accumulation, a warp reduction. It is faster than
MLX's GEMM at 2-8 rows and slower than MLX's
GEMV at one row and than its GEMM at a vocabulary-sized output, so it takes neither. Each output
is the same sum in the same order for any M in 2..8, so within that range a row's result does not
depend on the rows beside it; a row alone still runs MLX's GEMV, whose sums differ from both.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .device import on_cuda

MIN_ROWS, MAX_ROWS = 2, 8  # one row stays MLX's GEMV, which streams faster than this kernel
MAX_FEATURES = 32768  # a vocabulary-sized output (lm_head) keeps MLX's GEMM, efficient at that width

_SOURCE = """
    const int K = w_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x;
    const int n = blockIdx.y * blockDim.y + threadIdx.y;
    if (n >= N) return;
    constexpr int V = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int U = 4;               // loads of the weight row in flight per lane
    constexpr int STEP = 32 * V;
    const T* w_ = w + (size_t)n * K;
    // Views can start anywhere; 16-byte loads need 16-byte addresses (K % V == 0 keeps every row so).
    const bool vec = ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(w)) & 15) == 0;
    float acc[M];
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    int k = lane * V;
    if (vec) {
      for (; k + (U - 1) * STEP < K; k += U * STEP) {
        uint4 wv[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) wv[u] = __ldg(reinterpret_cast<const uint4*>(w_ + k + u * STEP));
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          #pragma unroll
          for (int u = 0; u < U; ++u) {
            const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K + k + u * STEP));
            const T* wp = reinterpret_cast<const T*>(&wv[u]);
            const T* xp = reinterpret_cast<const T*>(&xv);
            float s = 0.0f;
            #pragma unroll
            for (int j = 0; j < V; ++j) s += static_cast<float>(wp[j]) * static_cast<float>(xp[j]);
            acc[m] += s;
          }
        }
      }
    }
    // The tail (and unaligned views): the same sums in the same order, one position at a time.
    for (; k < K; k += STEP) {
      for (int m = 0; m < M; ++m) {
        float s = 0.0f;
        for (int j = 0; j < V; ++j) s += static_cast<float>(w_[k + j]) * static_cast<float>(x[(size_t)m * K + k + j]);
        acc[m] += s;
      }
    }
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float a = acc[m];
      for (int off = 16; off > 0; off /= 2) a += __shfl_xor_sync(0xffffffff, a, off);
      if (lane == 0) y[(size_t)m * N + n] = static_cast<T>(a);
    }
"""


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="skinny_matmul", input_names=["x", "w"], output_names=["y"], source=_SOURCE)


def supported(x: mx.array, w: mx.array) -> bool:
    """Whether ``x @ w.T`` runs this kernel here: a CUDA device, MIN_ROWS..MAX_ROWS rows, at most
    MAX_FEATURES outputs, 2-byte floats, K a multiple of 8 (16-byte loads)."""
    K = w.shape[-1]
    rows = x.size // K if K else 0
    return (
        on_cuda()
        and w.ndim == 2
        and x.shape[-1] == K
        and MIN_ROWS <= rows <= MAX_ROWS
        and w.shape[0] <= MAX_FEATURES
        and x.dtype == w.dtype
        and w.dtype in (mx.bfloat16, mx.float16)
        and K % 8 == 0
    )


def skinny_matmul(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` for x [..., K] with at most MAX_ROWS rows and w [N, K] (see ``supported``)."""
    N, K = w.shape
    M = x.size // K
    (y,) = _kernel()(
        inputs=[x.reshape(M, K), w],
        template=[("T", w.dtype), ("M", M)],
        grid=(32, (N + 3) // 4 * 4, 1),
        threadgroup=(32, 4, 1),
        output_shapes=[(M, N)],
        output_dtypes=[w.dtype],
    )
    return y.reshape(*x.shape[:-1], N)


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose few-row products run ``skinny_matmul`` (more rows: MLX's matmul); the class plain
    linear layers take on a CUDA device (swaps.py)."""

    def __call__(self, x: mx.array) -> mx.array:
        if not self.training and supported(x, self.weight):
            y = skinny_matmul(x, self.weight)
            return y + self.bias if "bias" in self else y
        return super().__call__(x)
