"""Reading the rows' KV blocks into the dense [B, H, n, D] keys attention takes.

Each step, every attention layer reads every row's blocks out of its pool. MLX's general gather
(``pool[:, idx]``) is several times slower than a plain copy for these few-MB reads on a GPU, and
runs twice per layer and step (keys, values): much of the blocks' step cost. On MLX's CUDA backend the read is one
copy kernel for keys and values together: a thread moves 16 bytes of one position of one head of
each, writing the outputs contiguous, bit for bit what the gather gives. Elsewhere (CPU, Metal)
MLX's gather stays.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

from .device import on_cuda

_SOURCE = """
    const int H = keys_shape[0];
    const int S = keys_shape[1];
    const int D = keys_shape[2];
    const int B = idx_shape[0];
    const int n = idx_shape[1];
    constexpr int V = 16 / sizeof(T);  // elements per 16-byte copy
    const int DV = D / V;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * H * n * DV) return;
    const int dv = i % DV;
    size_t rest = i / DV;
    const int p = rest % n; rest /= n;
    const int h = rest % H;
    const int b = rest / H;
    const int slot = idx[(size_t)b * n + p];
    const size_t at = ((size_t)h * S + slot) * D;
    reinterpret_cast<uint4*>(out_keys)[i] = __ldg(reinterpret_cast<const uint4*>(keys + at) + dv);
    reinterpret_cast<uint4*>(out_values)[i] = __ldg(reinterpret_cast<const uint4*>(values + at) + dv);
"""


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="kv_block_gather", input_names=["keys", "values", "idx"], output_names=["out_keys", "out_values"],
        source=_SOURCE,
    )


def _copy_kernel_fits(keys: mx.array, values: mx.array) -> bool:
    return (
        on_cuda()
        and keys.shape == values.shape
        and keys.dtype == values.dtype
        and keys.itemsize in (2, 4)
        and (keys.shape[2] * keys.itemsize) % 16 == 0
    )


def gather_rows(keys: mx.array, values: mx.array, idx: mx.array) -> tuple[mx.array, mx.array]:
    """Pools ``keys``/``values`` [H, slots, D], ``idx`` [B, n] slots: both as [B, H, n, D] with
    [b, :, p] = pool[:, idx[b, p]]."""
    if not _copy_kernel_fits(keys, values):
        return keys[:, idx].transpose(1, 0, 2, 3), values[:, idx].transpose(1, 0, 2, 3)
    H, _, D = keys.shape
    B, n = idx.shape
    out_keys, out_values = _kernel()(
        inputs=[keys, values, idx],
        template=[("T", keys.dtype)],
        grid=(B * H * n * (D * keys.itemsize // 16), 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(B, H, n, D), (B, H, n, D)],
        output_dtypes=[keys.dtype, keys.dtype],
    )
    return out_keys, out_values
