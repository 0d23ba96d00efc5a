"""SpecPrefill's per-token RoPE (specprefill/sparse_prefill.py ``rope_at``): its layout keeps MLX 0.32's CUDA launch in
CUDA's block limits for the tiny models' 16 rotated dims, and rotates every token exactly as the dense forward does."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from vllm_mlx_mtp_routing.specprefill.sparse_prefill import rope_at, rows_per_token


def mlx_block_dims(dim0: int, dim1: int, dim2: int) -> tuple[int, int, int]:
    """MLX 0.32's ``get_block_dims_common`` (mlx/backend/common/utils.cpp), which its CUDA RoPE launches with."""
    pows = [0, 0, 0]
    total = 0
    while True:
        before = total
        for axis, dim in enumerate((dim0, dim1, dim2)):
            if dim >= 1 << (pows[axis] + 1):
                pows[axis] += 1
                total += 1
            if total == 10:
                return (1 << pows[0], 1 << pows[1], 1 << pows[2])
        if total == before:
            return (1 << pows[0], 1 << pows[1], 1 << pows[2])


@pytest.mark.parametrize("dims", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 7, 2048])
def test_launch_block_stays_within_cuda_limits(dims: int, tokens: int) -> None:
    rope = nn.RoPE(dims)
    rows = rows_per_token(rope, 256)
    for heads in (2, 6, 32):
        # MLX's batched-offset RoPE kernel: (rotated pairs, rows, batch x ceil(heads / 4)) threads
        bx, by, bz = mlx_block_dims(dims // 2, rows, tokens * -(-heads // 4))
        assert bz <= 64 and bx * by * bz <= 1024


def test_one_row_per_token_hits_the_limit_the_layout_avoids() -> None:
    # Without the extra rows, 16 rotated dims over 2048 tokens ask for a block 128 threads deep.
    assert mlx_block_dims(8, 1, 2048 * 2)[2] == 128
    assert rows_per_token(nn.RoPE(16), 64) == 2
    assert rows_per_token(nn.RoPE(64), 256) == 1


@pytest.mark.parametrize("dims", [16, 64])
def test_rope_at_matches_consecutive_rotation_bitwise(dims: int) -> None:
    rope = nn.RoPE(dims, base=10_000_000.0)
    x = mx.random.normal((1, 3, 40, 64), key=mx.random.key(2))
    start = 17
    dense = rope(x, offset=start)  # mlx-lm's rotation of a chunk at consecutive positions
    got = rope_at(rope, x, mx.arange(start, start + 40, dtype=mx.int32))
    assert mx.array_equal(got, dense).item()
    # Scattered positions: each token as if alone at its position.
    pos = [0, 5, 6, 300, 4095]
    xs = x[:, :, : len(pos)]
    got = rope_at(rope, xs, mx.array(pos, dtype=mx.int32))
    alone = mx.concatenate([rope(xs[:, :, i : i + 1], offset=p) for i, p in enumerate(pos)], axis=2)
    assert mx.array_equal(got, alone).item()
