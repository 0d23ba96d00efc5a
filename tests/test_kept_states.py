"""The MTP rollback of gated-delta states (backbone.rollback_rows) from states kept as one [B, S, ...] array, as the
CUDA kernels keep them, takes the same bits as from one array a position, as the CPU and Metal paths keep them; the
one-launch kernel (model/kernels/kept_states.py) runs only on CUDA, where benchmarks/gpu/layer_check.py checks it
copies the same bits."""

from __future__ import annotations

import mlx.core as mx
import pytest

from vllm_mlx_mtp_routing.model.backbone import Captured, backbone_forward, rollback_rows
from vllm_mlx_mtp_routing.model.kernels import kept_states


def _rolled_back(model, keep: list[int], fed: int, stacked: bool) -> list[mx.array]:
    cache = model.make_cache()
    model(mx.array([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5], [1, 2, 3, 4, 5]]), cache=cache)
    tokens = mx.array([[10 + t for t in range(fed)], [30 + t for t in range(fed)], [50 + t for t in range(fed)]])
    _, _, captured = backbone_forward(model, tokens, cache, capture=True)
    assert all(isinstance(c.states, list) for c in captured)  # off CUDA: one array a position
    if stacked:
        captured = [Captured(c.cache, c.conv_input, mx.stack(c.states, axis=1), c.before, c.after) for c in captured]
    rollback_rows(cache, captured, keep, fed)
    mx.eval([c.state for c in cache])
    return [a for c in cache for a in c.state]


@pytest.mark.parametrize(("keep", "fed"), [([1, 2, 2], 2), ([3, 1, 2], 3), ([1, 1, 3], 3)])
def test_a_rollback_from_one_array_equals_one_a_position(tiny, keep: list[int], fed: int) -> None:
    model = tiny[0].model
    want, got = _rolled_back(model, keep, fed, stacked=False), _rolled_back(model, keep, fed, stacked=True)
    assert len(want) == len(got) and all(mx.array_equal(a, b).item() for a, b in zip(want, got))


def test_the_verify_keeps_the_conv_states_the_kernel_reads(tiny) -> None:
    model = tiny[0].model
    cache = model.make_cache()
    model(mx.array([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]]), cache=cache)
    _, _, captured = backbone_forward(model, mx.array([[10, 11, 12], [30, 31, 32]]), cache, capture=True)
    for cap in captured:  # [before; inputs] = the window input, and after = its last positions
        assert cap.before is not None and cap.after is not None
        n_keep = cap.before.shape[1]
        assert mx.array_equal(cap.conv_input[:, :n_keep], cap.before).item()
        assert mx.array_equal(cap.conv_input[:, -n_keep:], cap.after).item()


def test_the_one_launch_kernel_is_cuda_only() -> None:
    kept = [mx.zeros((2, 3, 4, 8, 32))]
    conv = [mx.zeros((2, 3, 64))]
    assert kept_states.runs(kept, conv, conv) is False  # the CPU backend here
