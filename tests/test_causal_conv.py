"""Where the gated-delta conv takes the CUDA kernel (causal_conv.py): only a depthwise, unpadded nn.Conv1d in eval,
on a CUDA device, with an input in its dtype; everywhere else the module itself, bitwise. The kernel runs only on
MLX's CUDA backend: its values against nn.Conv1d and its first-call costs were checked there (docs/design-notes.md,
"Kernels")."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vllm_mlx_mtp_routing.model.kernels import causal_conv


def test_only_a_depthwise_conv_in_eval_on_cuda_takes_the_kernel(monkeypatch) -> None:
    conv = nn.Conv1d(16, 16, 4, groups=16, bias=False)
    conv.train(False)
    x = mx.random.normal((2, 9, 16))
    assert not causal_conv.supported(conv, x)  # the CPU: no kernel
    assert mx.array_equal(causal_conv.conv1d(conv, x), conv(x)).item()
    monkeypatch.setattr(causal_conv, "on_cuda", lambda: True)
    assert causal_conv.supported(conv, x)
    assert not causal_conv.supported(conv, x.astype(mx.bfloat16))  # another dtype than the weights
    assert not causal_conv.supported(conv, x[:, :3])  # shorter than the kernel
    padded = nn.Conv1d(16, 16, 4, padding=1, groups=16, bias=False)
    padded.train(False)
    dense = nn.Conv1d(16, 16, 4, bias=False)
    dense.train(False)
    assert not causal_conv.supported(padded, x) and not causal_conv.supported(dense, x)
    conv.train(True)
    assert not causal_conv.supported(conv, x)  # training keeps the module's own (differentiable) conv


def test_the_one_kernel_step_is_on_cuda_only_and_never_off_cuda(monkeypatch) -> None:
    conv = nn.Conv1d(16, 16, 4, groups=16, bias=False)
    conv.train(False)
    state, x = mx.random.normal((2, 3, 16)), mx.random.normal((2, 5, 16))
    assert causal_conv.conv_step_devices == {"cuda"}  # on where a GPU run measured it, and nowhere else
    monkeypatch.setattr(causal_conv, "conv_step_devices", {"cpu", "cuda"})
    assert not causal_conv.step_runs(conv, state, 5)  # the CPU: no CUDA kernel, the concatenation
    window = mx.concatenate([state, x], axis=1)
    y, last = causal_conv.conv_step(conv, state, x)
    assert mx.array_equal(y, conv(window)).item() and mx.array_equal(last, window[:, -3:]).item()
    monkeypatch.setattr(causal_conv, "on_cuda", lambda: True)
    monkeypatch.setattr(causal_conv, "kind", lambda: "cuda")
    assert causal_conv.step_runs(conv, state, 5) and causal_conv.step_runs(conv, state, 1)
    assert not causal_conv.step_runs(conv, state[:, :2], 5)  # a window of another length than K - 1
    assert not causal_conv.step_runs(conv, state.astype(mx.bfloat16), 5)  # another dtype than the weights


@pytest.mark.parametrize("batch", [1, 3])
def test_a_layer_that_keeps_only_the_windows_end_is_mlx_lms_layer(tiny, monkeypatch, batch) -> None:
    """Where the one-kernel step runs, a gated-delta layer keeps only the conv window's end (``window_only``); the
    kernel runs on CUDA only, so here the layer takes that path with the step's CPU arithmetic: the plumbing around
    it (the cache's next conv state, prompt chunks and one-token steps, the compiled step) is mlx-lm's layer bit for
    bit. The kernel's own values: benchmarks/gpu/conv_step_check.py on a GPU."""
    from vllm_mlx_mtp_routing.model import backbone
    from vllm_mlx_mtp_routing.model.kernels.compiled_decode import retrace
    from vllm_mlx_mtp_routing.model.mlx_lm_internals import ArraysCache, DecoderLayer

    bundle, _ = tiny
    taken, stepped = [], []
    monkeypatch.setattr(backbone, "step_runs", lambda *a: taken.append(a) or True)
    monkeypatch.setattr(backbone, "conv_step", lambda *a: stepped.append(a) or causal_conv.conv_step(*a))
    layer = next(layer for layer in bundle.model.model.layers if layer.is_linear)
    retrace([layer])  # traced again, on this path
    lin, H = layer.linear_attn, bundle.model.args.hidden_size
    rng = np.random.default_rng(batch)
    ours, ref = ArraysCache(size=2), ArraysCache(size=2)
    for S in (7, 1, 1, 3, 1):  # a prompt chunk, steps, another chunk
        x = mx.array(rng.normal(size=(batch, S, H)).astype(np.float32))
        got, want = layer(x, None, ours), DecoderLayer.__call__(layer, x, None, ref)
        assert mx.array_equal(got, want).item()
        assert ours[0].shape == (batch, lin.conv_kernel_size - 1, lin.conv_dim)
        assert all(mx.array_equal(a, b).item() for a, b in zip(ours.state, ref.state))
    retrace([layer])
    assert taken and stepped  # the layer took the one-kernel path (its conv and window from conv_step)
