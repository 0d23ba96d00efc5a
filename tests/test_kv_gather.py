"""Reading rows' KV blocks: gather_rows against a reference built position by position."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx_mtp_routing.model.kernels import kv_gather


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gather_rows_places_each_rows_slots_in_order(dtype) -> None:
    H, S, D, B, n = 2, 40, 16, 3, 7
    keys = mx.random.normal((H, S, D), key=mx.random.key(0)).astype(dtype)
    values = mx.random.normal((H, S, D), key=mx.random.key(1)).astype(dtype)
    idx = np.random.default_rng(2).integers(0, S, size=(B, n)).astype(np.int32)
    out_k, out_v = kv_gather.gather_rows(keys, values, mx.array(idx))
    assert out_k.shape == out_v.shape == (B, H, n, D) and out_k.dtype == dtype
    k, v = np.array(keys.astype(mx.float32)), np.array(values.astype(mx.float32))
    for b in range(B):
        for p in range(n):
            assert np.array_equal(np.array(out_k[b, :, p].astype(mx.float32)), k[:, idx[b, p]])
            assert np.array_equal(np.array(out_v[b, :, p].astype(mx.float32)), v[:, idx[b, p]])


def test_the_copy_kernel_is_only_taken_on_cuda() -> None:
    keys = mx.zeros((2, 8, 16), dtype=mx.bfloat16)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available() and not mx.metal.is_available()
    assert kv_gather._copy_kernel_fits(keys, keys) == on_cuda
    # a head dimension whose rows are not whole 16-byte copies keeps MLX's gather everywhere
    odd = mx.zeros((2, 8, 3), dtype=mx.bfloat16)
    assert not kv_gather._copy_kernel_fits(odd, odd)
