"""An MoE switch's expert products on MLX's CUDA backend, each expert's weights read once for all its tokens.

A decode call's (token, expert) pairs each run as a matrix-vector product under MLX's gather: a pair reads its
expert's weights whatever the other pairs route to. A verify of [token, drafts] routes several tokens of a row, and the
rows of a batch, to shared experts (35B-A3B, 24 tokens: 192 pairs over ~138 experts), so the gather reads some weights
two or three times. Here a thread block takes the first pair of each expert: it lists the call's pairs of that expert,
and each warp loads a weight row once into registers and multiplies it by every listed pair's input. Blocks of the
other pairs return at once, so the launch needs no sort.

Each product is MLX 0.32.4's ``gemv_gather`` sum (4 elements a lane, the lane's columns in order, fp32, the warp's
``cg::reduce``), so a pair's result does not depend on the pairs beside it or on which way computed it
(benchmarks/gpu/moe_ways_check.py compares the bits).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

WARPS = 8  # a block's warps: MLX's rows_per_block
# Rows a warp takes, by the weight's K: from 1024 (the gate and up experts) 4, below (the down experts) 8; a block then
# reads 64-128 KB of weights
ROWS = {1024: 4, 0: 8}
MAX_PAIRS = 1024  # the pairs a block lists: twice a measured decode call's most (64 tokens x 8 experts)

_HEADER = """
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
"""

_SOURCE = """
    auto warp = cg::tiled_partition<32>(cg::this_thread_block());
    const int per_token = idx_shape[1];
    const int P = idx_shape[0] * per_token;
    const int p = blockIdx.z;
    const int lane = threadIdx.x;
    const int tid = threadIdx.y * 32 + lane;
    #define IDX(q) idx[(size_t)((q) / per_token) * idx_strides[0] + (size_t)((q) % per_token) * idx_strides[1]]
    const auto e = IDX(p);
    __shared__ int n_match;
    __shared__ int taken;
    __shared__ int match[MaxPairs];
    if (tid == 0) { n_match = 0; taken = 0; }
    __syncthreads();
    for (int q = tid; q < p; q += 32 * Warps) if (IDX(q) == e) taken = 1;  // an earlier pair's block has this expert
    __syncthreads();
    if (taken) return;
    for (int q = tid; q < P; q += 32 * Warps) if (IDX(q) == e) match[atomicAdd(&n_match, 1)] = q;
    __syncthreads();
    #undef IDX
    const int n = n_match;
    const int experts = w_shape[0] / Sets;
    constexpr int V = 4;
    constexpr int ITERS = K / (32 * V);
    struct alignas(sizeof(T) * V) Vec { T v[V]; };
    const bool w_unit = w_strides[2] == 1;
    for (int r = 0; r < Rows; ++r) {
      const int g = (blockIdx.y * Rows + r) * Warps + threadIdx.y;  // this warp's row over the sets
      if (g >= Sets * N) break;
      const int s = g / N;
      const int row = g % N;
      // by the weight's strides: mlx-vlm's split of fused gate_up experts leaves views a row apart of their experts
      const T* w_row = w + (size_t)(e + s * experts) * w_strides[0] + (size_t)row * w_strides[1];
      Vec wr[ITERS];
      // the stride test outside the unrolled loads: inside them it slowed every load (docs/benchmarks.md)
      if (w_unit) {
        #pragma unroll
        for (int it = 0; it < ITERS; ++it) wr[it] = *reinterpret_cast<const Vec*>(w_row + (it * 32 + lane) * V);
      } else {
        #pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          #pragma unroll
          for (int j = 0; j < V; ++j) wr[it].v[j] = w_row[(size_t)((it * 32 + lane) * V + j) * w_strides[2]];
        }
      }
      for (int m = 0; m < n; ++m) {
        const int q = match[m];
        const T* x_row = x + (size_t)(PerPair ? q : q / per_token) * K;
        float sum = 0.0f;
        #pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          const Vec xv = *reinterpret_cast<const Vec*>(x_row + (it * 32 + lane) * V);
          #pragma unroll
          for (int j = 0; j < V; ++j) sum += static_cast<float>(wr[it].v[j]) * static_cast<float>(xv.v[j]);
        }
        sum = cg::reduce(warp, sum, cg::plus<float>{});
        if (lane == 0) out[((size_t)q * Sets + s) * N + row] = static_cast<T>(sum);
      }
    }
"""


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="expert_gemv", input_names=["x", "w", "idx"], output_names=["out"],
                               source=_SOURCE, header=_HEADER, ensure_row_contiguous=False)


def serves(weight: mx.array, pairs: int) -> bool:
    """Whether ``expert_gemv`` takes a switch weight [experts, N, K] (any strides) for a call of ``pairs`` pairs."""
    return (weight.ndim == 3 and weight.dtype in (mx.bfloat16, mx.float16, mx.float32)
            and weight.shape[2] % 128 == 0 and pairs <= MAX_PAIRS)


def expert_gemv(x: mx.array, weight: mx.array, indices: mx.array, sets: int = 1, per_pair: bool = False) -> mx.array:
    """Each pair's product with its expert: ``indices`` [tokens, k] (each pair's expert), ``weight`` [sets * experts,
    N, K] (set s of expert e at s * experts + e: fused_projections.py's stacked gate and up), x [tokens, K] or with
    ``per_pair`` [tokens * k, K] (a pair's own input) -> [tokens * k, sets, N]."""
    _, N, K = weight.shape
    pairs = indices.size
    rows = next(r for k, r in sorted(ROWS.items(), reverse=True) if K >= k)
    blocks_y = -(-sets * N // (WARPS * rows))
    (out,) = _kernel()(
        inputs=[mx.contiguous(x), weight, indices],
        template=[("T", x.dtype), ("K", K), ("N", N), ("Sets", sets), ("Rows", rows), ("Warps", WARPS),
                  ("PerPair", per_pair), ("MaxPairs", MAX_PAIRS)],
        grid=(32, WARPS * blocks_y, pairs),
        threadgroup=(32, WARPS, 1),
        output_shapes=[(pairs, sets, N)],
        output_dtypes=[x.dtype],
    )
    return out
