"""Which calls the gated-delta layer's CUDA kernel serves (model/kernels/gated_delta_layer.py ``runs``).

The kernel itself needs MLX's CUDA backend (its exactness: benchmarks/gpu/layer_check.py); what the CPU can check is
the dispatch: a call the kernel cannot compute as mlx-lm's ops would (a mask, a dtype it was not given, heads it does
not tile, training) must take the ops, and the CPU and Metal never take it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from vllm_mlx_mtp_routing.model.kernels import gated_delta_layer
from vllm_mlx_mtp_routing.model.mlx_lm_internals import GatedDeltaNet, TextModelArgs


def _layer(key_dim: int = 32, k_heads: int = 2, v_heads: int = 4) -> GatedDeltaNet:
    args = TextModelArgs.from_dict({
        "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6,
        "vocab_size": 128, "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads,
        "linear_key_head_dim": key_dim, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "tie_word_embeddings": True, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25},
    })
    lin = GatedDeltaNet(args)
    lin.train(False)
    return lin


def _inputs(lin: GatedDeltaNet, dtype: mx.Dtype = mx.float32, B: int = 2, T: int = 3) -> tuple[mx.array, mx.array]:
    K = lin.conv1d.weight.shape[1]
    return mx.zeros((B, T, lin.conv_dim), dtype=dtype), mx.zeros((B, K - 1, lin.conv_dim), dtype=dtype)


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(gated_delta_layer, "kind", lambda: "cuda")


def test_a_plain_call_on_cuda_takes_the_kernel(on_cuda):
    lin = _layer()
    assert gated_delta_layer.runs(lin, *_inputs(lin), None)


def test_the_cpu_and_metal_never_take_it(monkeypatch):
    lin = _layer()
    # even switched on there (a benchmark's A/B adds the device it runs on): the kernel has no other backend
    monkeypatch.setattr(gated_delta_layer, "fused_layer_devices", {"cuda", "cpu", "metal"})
    for device in ("cpu", "metal"):
        monkeypatch.setattr(gated_delta_layer, "kind", lambda device=device: device)
        assert not gated_delta_layer.runs(lin, *_inputs(lin), None)


def test_a_device_switched_off_takes_the_ops(on_cuda, monkeypatch):
    lin = _layer()
    monkeypatch.setattr(gated_delta_layer, "fused_layer_devices", set())
    assert not gated_delta_layer.runs(lin, *_inputs(lin), None)


def test_calls_the_kernel_cannot_compute_take_the_ops(on_cuda):
    lin = _layer()
    qkv, conv_state = _inputs(lin)
    assert not gated_delta_layer.runs(lin, qkv, conv_state, mx.ones((2, 3), dtype=mx.bool_))  # a padded batch
    assert not gated_delta_layer.runs(lin, qkv.astype(mx.bfloat16), conv_state, None)  # not the weights' dtype
    assert not gated_delta_layer.runs(lin, qkv, conv_state[:1], None)  # a conv state of another batch
    assert not gated_delta_layer.runs(lin, qkv[..., :-1], conv_state, None)  # not the layer's channels
    narrow = _layer(key_dim=16)  # key heads narrower than a warp
    assert not gated_delta_layer.runs(narrow, *_inputs(narrow), None)
    lin.train(True)
    assert not gated_delta_layer.runs(lin, qkv, conv_state, None)
