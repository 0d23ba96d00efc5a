"""Where the gated-delta conv takes the CUDA kernel (causal_conv.py): only a depthwise, unpadded nn.Conv1d in eval,
on a CUDA device, with an input in its dtype; everywhere else the module itself, bitwise. The kernel runs only on
MLX's CUDA backend: its values against nn.Conv1d and its first-call costs were checked there (docs/design-notes.md,
"Kernels")."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

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
