"""A residual add and the RMS norm of its sum in one kernel, on MLX's CUDA backend.

Each decoder layer adds its mixer's output to the residual stream and normalizes the sum for its MLP: two launches,
the second reading back what the first wrote. ``add_norm`` writes the sum and its norm in one. The norm's arithmetic
is MLX's own CUDA ``rms_norm`` (its ``rms_norm_small`` kernel, mlx 0.32): the same block size and loads per thread
for the row's length, the same float32 sum of squares per thread, the same cooperative-groups reductions, the same
rounding of each product, so the values are MLX's bit for bit (benchmarks/gpu/add_norm_check.py checks it). Elsewhere,
or where the row is longer than that kernel takes, it is the two ops.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..mlx_lm_internals import DecoderLayer
from .device import kind, on_cuda

_HEADER = "#include <cooperative_groups/reduce.h>\n"

_SOURCE = """
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const size_t base = (size_t)blockIdx.x * D;
    const uint32_t tid = threadIdx.x;
    DT hv[CHUNKS][NREADS];
    float normalizer = 0;
    #pragma unroll
    for (int i = 0; i < CHUNKS; i++) {
        #pragma unroll
        for (int j = 0; j < NREADS; j++) {
            const uint32_t e = (BLOCK * i + tid) * NREADS + j;
            DT v = static_cast<DT>(0.0f);
            if (e < D) {
                v = static_cast<DT>(static_cast<float>(x[base + e]) + static_cast<float>(r[base + e]));
                h[base + e] = v;
            }
            hv[i][j] = v;
            float t = static_cast<float>(v);
            normalizer += t * t;
        }
    }
    normalizer = cg::reduce(warp, normalizer, cg::plus<float>());
    if (BLOCK > 32) {
        __shared__ float partial[BLOCK / 32 > 0 ? BLOCK / 32 : 1];
        if (warp.thread_rank() == 0) partial[warp.meta_group_rank()] = normalizer;
        block.sync();
        normalizer = warp.thread_rank() < warp.meta_group_size() ? partial[warp.thread_rank()] : 0.0f;
        normalizer = cg::reduce(warp, normalizer, cg::plus<float>());
    }
    const uint32_t axis_size = D;
    normalizer = rsqrtf(normalizer / axis_size + eps[0]);
    #pragma unroll
    for (int i = 0; i < CHUNKS; i++) {
        #pragma unroll
        for (int j = 0; j < NREADS; j++) {
            const uint32_t e = (BLOCK * i + tid) * NREADS + j;
            if (e < D) {
                float y_ = static_cast<float>(hv[i][j]) * normalizer;
                y[base + e] = w[e] * static_cast<DT>(y_);
            }
        }
    }
"""

# Where ``add_norm`` runs its one kernel: nowhere until a GPU run measures it (benchmarks/gpu/add_norm_check.py for
# its exactness, decode_variants.py --options add_norm for its time). Elsewhere it is the add and the norm.
add_norm_devices: set[str] = set()


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="residual_add_rms_norm", input_names=["x", "r", "w", "eps"],
                               output_names=["h", "y"], source=_SOURCE, header=_HEADER)


@cache
def _eps(value: float) -> mx.array:
    return mx.array([value], dtype=mx.float32)


def launch_shape(D: int, dtype: mx.Dtype) -> tuple[int, int, int] | None:
    """(threads per row, vector loads per thread, elements per load) of MLX's small-row ``rms_norm`` for rows of
    ``D`` (its ``dispatch_num_chunks``), or None where MLX takes its other kernel."""
    reads = 16 // dtype.size
    if D > reads * 128 * 8:
        return None
    nvec = (D + reads - 1) // reads
    if D <= reads * 64:
        return 64, 1, reads
    if nvec % 128 == 0 and nvec // 128 <= 8:
        return 128, nvec // 128, reads
    if nvec % 64 == 0 and nvec // 64 <= 8:
        return 64, nvec // 64, reads
    return 128, min((nvec + 127) // 128, 8), reads


def runs(x: mx.array, norm: nn.Module) -> bool:
    """Whether ``add_norm(x, r, norm)`` runs its one kernel here: on (``add_norm_devices``), an ``nn.RMSNorm`` whose
    weight is a row of x's length and dtype, a row short enough for MLX's small-row kernel."""
    w = getattr(norm, "weight", None)
    return (on_cuda() and kind() in add_norm_devices and type(norm) is nn.RMSNorm and w is not None and w.ndim == 1
            and x.ndim >= 1 and w.shape[0] == x.shape[-1] and w.dtype == x.dtype
            and x.dtype in (mx.float32, mx.float16, mx.bfloat16) and launch_shape(x.shape[-1], x.dtype) is not None)


def add_norm(x: mx.array, r: mx.array, norm: nn.Module) -> tuple[mx.array, mx.array]:
    """(x + r, norm(x + r)): one kernel where it runs (``runs``), else the two ops; the same values either way."""
    if not runs(x, norm) or r.shape != x.shape or r.dtype != x.dtype:
        h = x + r
        return h, norm(h)
    D = x.shape[-1]
    shape = launch_shape(D, x.dtype)
    assert shape is not None
    block, chunks, reads = shape
    rows = x.size // D
    h, y = _kernel()(
        inputs=[x, r, norm.weight, _eps(float(norm.eps))],
        template=[("DT", x.dtype), ("D", D), ("BLOCK", block), ("CHUNKS", chunks), ("NREADS", reads)],
        grid=(rows * block, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return h, y


def layer_tail(layer: DecoderLayer, x: mx.array, r: mx.array) -> mx.array:
    """What follows a decoder layer's mixer (its output ``r``, its input ``x``): the residual, the post-attention norm
    (with the residual as ``add_norm``), the MLP, the residual."""
    h, n = add_norm(x, r, layer.post_attention_layernorm)
    return h + layer.mlp(n)


def layer_call(layer: DecoderLayer, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
    """mlx-lm's ``DecoderLayer.__call__`` with the residual add and the post-attention norm as ``add_norm``: the same
    ops in the same order where that is off."""
    normed = layer.input_layernorm(x)
    r = layer.linear_attn(normed, mask, cache) if layer.is_linear else layer.self_attn(normed, mask, cache)
    return layer_tail(layer, x, r)


class AddNormDecoderLayer(DecoderLayer):
    """mlx-lm's decoder layer run as ``layer_call``; the class the text model's layers take on CUDA (swaps.py)."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        return layer_call(self, x, mask, cache)
