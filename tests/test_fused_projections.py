"""Projections of one input as one matmul (model/kernels/fused_projections.py): the same outputs bitwise on the CPU,
no new memory, fewer ops in the model's graph."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from vllm_mlx_mtp_routing.model.backbone import FusedGatedDeltaNet
from vllm_mlx_mtp_routing.model.kernels.fused_projections import (
    _FUSED,
    FusedMLP,
    FusedSparseMoeBlock,
    attach,
    detach,
    fuse,
    fuse_into,
    fused_of,
    project,
)
from vllm_mlx_mtp_routing.model.kernels.grouped_attention import GroupedAttention
from vllm_mlx_mtp_routing.model.text_model import assert_zero_copy, build_text_model

H = 256
SHAPES = [(1, 1, H), (4, 1, H), (4, 2, H), (1, 33, H)]


def _parts(kind: str, sizes: tuple[int, ...] = (384, 128, 8, 8)) -> nn.Module:
    mx.random.seed(3)
    module = nn.Module()
    for i, n in enumerate(sizes):
        layer: nn.Module = nn.Linear(H, n, bias=False)
        if kind == "bfloat16":
            layer.set_dtype(mx.bfloat16)
        elif kind.startswith("q"):
            layer = nn.QuantizedLinear.from_linear(layer, group_size=64, bits=int(kind[1:]))
        setattr(module, f"p{i}", layer)
    mx.eval(module.parameters())
    return module


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q4", "q8"])
def test_fused_projection_is_bitwise_the_separate_ones(kind):
    module = _parts(kind)
    names = ("p0", "p1", "p2", "p3")
    xs = [mx.random.normal(s).astype(mx.bfloat16 if kind == "bfloat16" else mx.float32) for s in SHAPES]
    expected = [[getattr(module, n)(x) for n in names] for x in xs]
    mx.eval(expected)
    before = {k: mx.array(v) for k, v in tree_flatten(module.parameters())}
    assert fuse_into(module, names)
    assert module.__dict__[_FUSED] is not None
    for x, want in zip(xs, expected):
        got = project(module, names, x)
        assert [g.shape for g in got] == [w.shape for w in want]
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))
        # the parts still answer alone (mlx-lm's and mlx-vlm's own calls), from views of the same values
        assert all(mx.array_equal(getattr(module, n)(x), w).item() for n, w in zip(names, want))
    after = dict(tree_flatten(module.parameters()))
    assert after.keys() == before.keys()  # the fused module is not a parameter
    assert all(mx.array_equal(after[k], v).item() for k, v in before.items())


def test_the_parts_become_views_no_new_memory():
    module = _parts("float32", sizes=(1024, 1024, 1024, 1024))  # 4 MiB each
    gc.collect()
    base = mx.get_active_memory()
    assert fuse_into(module, ("p0", "p1", "p2", "p3"))
    gc.collect()
    grown = mx.get_active_memory() - base
    assert grown < 1 << 20, f"{grown} bytes more after fusing 16 MiB of weights"


def test_parts_that_differ_are_left_alone():
    module = nn.Module()
    module.a = nn.QuantizedLinear.from_linear(nn.Linear(H, 64, bias=False), group_size=64, bits=4)
    module.b = nn.QuantizedLinear.from_linear(nn.Linear(H, 64, bias=False), group_size=64, bits=8)
    module.c = nn.Linear(H, 64, bias=False)
    mx.eval(module.parameters())
    assert fuse([module.a, module.b]) is None
    assert fuse([module.a, module.c]) is None
    assert not fuse_into(module, ("a", "b"))
    x = mx.random.normal((2, 1, H))
    got = project(module, ("a", "b"), x)  # falls back to the separate calls
    assert all(mx.array_equal(g, getattr(module, n)(x)).item() for g, n in zip(got, ("a", "b")))


def _graph_matmuls(model: nn.Module, ids: mx.array, tmp_path: Path) -> int:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), model(ids))
    return sum(line.count('label ="Matmul"') for line in path.read_text().splitlines())


def test_the_text_model_fuses_and_computes_the_same(tiny_vlm_fp32, tmp_path):
    from mlx_vlm import load

    vlm, _ = load(str(tiny_vlm_fp32))
    bundle = build_text_model(vlm, tiny_vlm_fp32, json.loads((tiny_vlm_fp32 / "config.json").read_text()))
    model = bundle.model
    gated = [layer.linear_attn for layer in model.model.layers if layer.is_linear]
    attention = [layer.self_attn for layer in model.model.layers if not layer.is_linear]
    mlps = [m for _, m in model.named_modules() if isinstance(m, FusedMLP)]
    assert gated and all(type(lin) is FusedGatedDeltaNet and _FUSED in lin.__dict__ for lin in gated)
    assert attention and all(type(a) is GroupedAttention and _FUSED in a.__dict__ for a in attention)
    assert _FUSED not in bundle.mtp.layers[0].self_attn.__dict__  # the head's arrays may be a host drafter's
    assert len(mlps) == len(model.model.layers)
    assert assert_zero_copy(vlm, model) == bundle.shared_arrays  # the VLM holds the same views
    assert bundle.extra_bytes <= bundle.mtp_bytes + (1 << 20)

    ids = mx.array([[11, 200, 37, 4000, 5, 981, 42, 7, 300]])
    fused_logits = model(ids)
    fused_matmuls = _graph_matmuls(model, ids, tmp_path)
    made = detach(model)  # the separate projections, on the same views
    assert len(made) == len(gated) + len(attention) + len(mlps)
    try:
        assert mx.array_equal(model(ids), fused_logits).item()
        assert _graph_matmuls(model, ids, tmp_path) - fused_matmuls == 3 * len(gated) + 2 * len(attention) + len(mlps)
    finally:
        attach(made)
    assert all(_FUSED in m.__dict__ for m in [*gated, *attention, *mlps])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the CPU's float32 expert call, stacked
def test_moe_shared_expert_and_switch_fuse(moe_vlm_factory, dtype):
    """The MoE blocks' router, shared expert gate and shared expert (gate and up) as one matmul, and their switch (gate
    and up experts stacked, one gather): the same logits as part by part, the VLM still sharing every array."""
    from mlx_vlm import load

    path = moe_vlm_factory(dtype=dtype)
    vlm, _ = load(str(path))
    bundle = build_text_model(vlm, path, json.loads((path / "config.json").read_text()))
    model = bundle.model
    blocks = [layer.mlp for layer in model.model.layers]
    switches = [block.switch_mlp for block in blocks]
    assert blocks and all(type(b) is FusedSparseMoeBlock for b in blocks)
    fused, splits = fused_of(blocks[0])
    experts, inner = blocks[0].gate.weight.shape[0], blocks[0].shared_expert.gate_proj.weight.shape[0]
    assert splits == [experts, experts + 1, experts + 1 + inner] and fused.weight.shape[0] == experts + 1 + 2 * inner
    # the shared expert's own gate and up are parts of the block's matmul, not fused again on their own
    assert all(fused_of(b.shared_expert) is None for b in blocks)
    assert all(fused_of(m) is not None for m in switches)
    stacked, (experts,) = fused_of(switches[0])
    assert experts == switches[0].gate_proj.weight.shape[0] and stacked.weight.shape[0] == 2 * experts
    assert type(stacked) is type(switches[0].gate_proj)  # the class the device gave the experts (bf16: float32 calls)
    assert (type(stacked).__name__.startswith("Float32")) == (dtype == "bfloat16")
    assert assert_zero_copy(vlm, model) == bundle.shared_arrays

    ids = mx.array([[11, 200, 37, 400, 5, 981, 42]])  # 7 tokens: the unsorted gather, where the stacked one runs
    fused_logits = model(ids)
    made = detach(model)
    try:
        assert mx.array_equal(model(ids), fused_logits).item()
    finally:
        attach(made)
