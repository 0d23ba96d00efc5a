"""The residual add and its RMS norm in one kernel (model/kernels/add_norm.py), where it runs and what it gives elsewhere.

The kernel is CUDA's (its bitwise check against MLX's own add and rms_norm: benchmarks/gpu/add_norm_check.py); here:
its launch shape is MLX's small-row rms_norm's for every row length that kernel takes, off CUDA it is never chosen
(whatever the device set says) and gives the add and the norm, and the decoder layer's call built on it is mlx-lm's
layer bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vllm_mlx_mtp_routing.model.kernels import add_norm as an
from vllm_mlx_mtp_routing.model.mlx_lm_internals import ArraysCache, DecoderLayer


@pytest.mark.parametrize(
    ("D", "dtype", "want"),
    [
        (64, mx.bfloat16, (64, 1, 8)),  # up to 64 vector loads: one a thread of 64
        (100, mx.bfloat16, (64, 1, 8)),
        (2048, mx.bfloat16, (128, 2, 8)),  # Qwen3.5-2B's and 35B-A3B's hidden size
        (4096, mx.bfloat16, (128, 4, 8)),  # 9B's
        (5120, mx.bfloat16, (128, 5, 8)),
        (8192, mx.bfloat16, (128, 8, 8)),
        (8200, mx.bfloat16, None),  # past 8 loads a thread: MLX's other kernel, not this one
        (2048, mx.float32, (128, 4, 4)),
        (4096, mx.float32, (128, 8, 4)),
        (4100, mx.float32, None),
        (576, mx.float16, (128, 1, 8)),  # 72 loads, a multiple of neither 128 nor 64: 128 threads, one load each
    ],
)
def test_the_launch_shape_is_mlxs_small_row_rms_norms(D, dtype, want):
    assert an.launch_shape(D, dtype) == want


def test_off_cuda_it_is_the_add_and_the_norm_whatever_the_device_set(monkeypatch):
    assert not an.add_norm_devices  # on nowhere until a GPU run measures it
    monkeypatch.setattr(an, "add_norm_devices", {"cpu", "cuda", "metal"})
    norm = nn.RMSNorm(48, eps=1e-6)
    norm.weight = mx.random.normal((48,))
    x, r = mx.random.normal((2, 3, 48)), mx.random.normal((2, 3, 48))
    assert not an.runs(x, norm)
    h, y = an.add_norm(x, r, norm)
    assert mx.array_equal(h, x + r).item() and mx.array_equal(y, norm(x + r)).item()


def test_it_would_run_only_for_a_plain_rms_norm_of_the_rows_length_and_dtype(monkeypatch):
    monkeypatch.setattr(an, "add_norm_devices", {"cuda"})
    monkeypatch.setattr(an, "kind", lambda: "cuda")
    monkeypatch.setattr(an, "on_cuda", lambda: True)
    norm = nn.RMSNorm(64)
    x = mx.zeros((1, 1, 64))
    assert an.runs(x, norm)
    assert not an.runs(x.astype(mx.bfloat16), norm)  # another dtype than the weight
    assert not an.runs(mx.zeros((1, 1, 32)), norm)  # another length
    assert not an.runs(x, nn.LayerNorm(64))  # another norm
    big = nn.RMSNorm(4100)
    assert not an.runs(mx.zeros((1, 4100)), big)  # float32 past MLX's small-row kernel


def test_the_layer_call_is_mlx_lms_layer_bit_for_bit(tiny):
    bundle, _ = tiny
    rng = np.random.default_rng(0)
    H = bundle.model.args.hidden_size
    for layer in bundle.model.model.layers[:4]:  # gated-delta and attention layers
        x = mx.array(rng.normal(size=(2, 3, H)).astype(np.float32))
        if layer.is_linear:
            ours, ref = ArraysCache(size=2), ArraysCache(size=2)
        else:
            ours = ref = None
        got = an.layer_call(layer, x, None, ours)
        want = DecoderLayer.__call__(layer, x, None, ref)
        assert mx.array_equal(got, want).item()
