"""The gated-delta layer the text model runs on CUDA (backbone.gated_delta_layer, the class
FusedGatedDeltaNet) is mlx-lm's layer with only the recurrence swapped: on CPU, where the
recurrence stays mlx-lm's, it must give bitwise mlx-lm's outputs and cache states, with and
without padding masks, per-row lengths and an empty cache. The fused kernel itself runs only on
MLX's CUDA backend: its exactness properties (chunked = whole, batched = alone, capture = per
position) are checked there by benchmarks/gpu/recurrence_check.py, results in docs/benchmarks.md."""

from __future__ import annotations

import mlx.core as mx
import pytest

from vllm_mlx_mtp_routing.model.backbone import FusedGatedDeltaNet, gated_delta_layer
from vllm_mlx_mtp_routing.model.kernels.device import on_cuda
from vllm_mlx_mtp_routing.model.kernels.swaps import use_fused_recurrence
from vllm_mlx_mtp_routing.model.mlx_lm_internals import ArraysCache, GatedDeltaNet


def _linear_layer(bundle):
    return next(layer.linear_attn for layer in bundle.model.model.layers if layer.is_linear)


def _cache(B: int, lin, seed: int, lengths: list[int] | None = None) -> ArraysCache:
    mx.random.seed(seed)
    c = ArraysCache(size=2)
    c[0] = mx.random.normal((B, lin.conv_kernel_size - 1, lin.conv_dim)) * 0.1
    c[1] = mx.random.normal((B, lin.num_v_heads, lin.head_v_dim, lin.head_k_dim)) * 0.1
    if lengths is not None:
        c.prepare(lengths=lengths)
    return c


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("case", ["no_cache", "cache", "mask", "lengths"])
def test_layer_equals_mlx_lm(tiny, case: str) -> None:
    bundle, _ = tiny
    lin = _linear_layer(bundle)
    B, S = 3, 7
    mx.random.seed(1)
    x = mx.random.normal((B, S, lin.hidden_size))
    mask = mx.array([[t >= p for t in range(S)] for p in (0, 2, 5)]) if case == "mask" else None
    lengths = [7, 4, 1] if case == "lengths" else None
    ours_cache = None if case == "no_cache" else _cache(B, lin, 2, lengths)
    ref_cache = None if case == "no_cache" else _cache(B, lin, 2, lengths)

    ours, conv_input, states = gated_delta_layer(lin, x, mask, ours_cache)
    ref = GatedDeltaNet.__call__(lin, x, mask, ref_cache)
    assert states == [] and conv_input.shape[1] == S + lin.conv_kernel_size - 1
    assert _same(ours, ref)
    if ours_cache is not None:
        assert _same(ours_cache[0], ref_cache[0]) and _same(ours_cache[1], ref_cache[1])


def test_capture_final_state_equals_plain(tiny) -> None:
    bundle, _ = tiny
    lin = _linear_layer(bundle)
    mx.random.seed(3)
    x = mx.random.normal((2, 5, lin.hidden_size))
    plain, cap = _cache(2, lin, 4), _cache(2, lin, 4)
    y0, _, _ = gated_delta_layer(lin, x, None, plain)
    y1, _, states = gated_delta_layer(lin, x, None, cap, capture=True)
    assert len(states) == 5 and _same(states[-1], cap[1])
    assert mx.allclose(y0, y1, atol=1e-6).item() and mx.allclose(plain[1], cap[1], atol=1e-6).item()


def test_fused_class_is_transparent_off_cuda(tiny) -> None:
    bundle, _ = tiny
    assert not on_cuda()  # CPU: no fused recurrence; the layers take the class for their fused input projections
    assert use_fused_recurrence(bundle.model) == 0
    assert all(type(layer.linear_attn) is FusedGatedDeltaNet for layer in bundle.model.model.layers if layer.is_linear)
    lin = _linear_layer(bundle)
    mx.random.seed(5)
    x = mx.random.normal((1, 4, lin.hidden_size))
    ref = GatedDeltaNet.__call__(lin, x, None, _cache(1, lin, 6))  # mlx-lm's own call, projection by projection
    assert _same(lin(x, None, _cache(1, lin, 6)), ref)
