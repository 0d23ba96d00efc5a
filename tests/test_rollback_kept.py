"""The MTP rollback of gated-delta states (backbone.rollback_rows) from states kept as one [B, S, ...] array, as the
CUDA kernels keep them, takes the same bits as from one array a position, as the CPU and Metal paths keep them."""

from __future__ import annotations

import mlx.core as mx
import pytest

from vllm_mlx_mtp_routing.model.backbone import Captured, backbone_forward, rollback_rows


def _rolled_back(model, keep: list[int], fed: int, stacked: bool) -> list[mx.array]:
    cache = model.make_cache()
    model(mx.array([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5], [1, 2, 3, 4, 5]]), cache=cache)
    tokens = mx.array([[10 + t for t in range(fed)], [30 + t for t in range(fed)], [50 + t for t in range(fed)]])
    _, _, captured = backbone_forward(model, tokens, cache, capture=True)
    assert all(isinstance(c.states, list) for c in captured)  # off CUDA: one array a position
    if stacked:
        captured = [Captured(c.cache, c.conv_input, mx.stack(c.states, axis=1)) for c in captured]
    rollback_rows(cache, captured, keep, fed)
    mx.eval([c.state for c in cache])
    return [a for c in cache for a in c.state]


@pytest.mark.parametrize(("keep", "fed"), [([1, 2, 2], 2), ([3, 1, 2], 3), ([1, 1, 3], 3)])
def test_a_rollback_from_one_array_equals_one_a_position(tiny, keep: list[int], fed: int) -> None:
    model = tiny[0].model
    want, got = _rolled_back(model, keep, fed, stacked=False), _rolled_back(model, keep, fed, stacked=True)
    assert len(want) == len(got) and all(mx.array_equal(a, b).item() for a, b in zip(want, got))
