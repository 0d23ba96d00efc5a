"""The MoE switch's dispatch (model/kernels/moe_dispatch.py): per call size, from times measured on the loaded model.

The plain step and the MTP verify of one batch size must not be split by mlx-lm's fixed threshold (at 8 experts a token
and 4 rows: 32 pairs gather, 64 sort) but each take the way measured fastest for its size; on MLX's CPU backend every
way gives the same bits, so the choice cannot change an output there (the fp32 MoE model's greedy tests run
unchanged: test_moe_e2e.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from vllm_mlx_mtp_routing.model.kernels.moe_dispatch import (
    BY_EXPERT,
    GATHER,
    MEASURED_TOKENS,
    MLX_LM,
    SORTED,
    WAYS,
    DispatchedSwitchGLU,
    DispatchPlan,
    set_plan,
)


def test_plan_takes_the_measured_way_per_size_and_mlx_lms_rule_past_it() -> None:
    # mlx-lm's rule splits a batch of 4 rows at 8 experts a token: the plain step gathers, the verify sorts
    assert MLX_LM.way(tokens=4, pairs=32) == GATHER and MLX_LM.way(tokens=8, pairs=64) == SORTED
    plan = DispatchPlan(way_at=((1, GATHER), (4, GATHER), (8, GATHER), (16, SORTED), (24, BY_EXPERT)))
    assert plan.way(tokens=4, pairs=32) == plan.way(tokens=8, pairs=64) == GATHER  # the same way for both
    assert plan.way(tokens=3, pairs=24) == GATHER  # a size between two measured ones takes the larger one's way
    assert plan.way(tokens=9, pairs=72) == plan.way(tokens=16, pairs=128) == SORTED
    assert plan.way(tokens=17, pairs=136) == plan.way(tokens=24, pairs=192) == BY_EXPERT
    assert plan.way(tokens=25, pairs=8) == GATHER and plan.way(tokens=512, pairs=4096) == SORTED  # past it: mlx-lm's
    assert plan.describe() == ("gather at 1-8 tokens, sorted at 9-16 tokens, by_expert at 17-24 tokens; "
                               "past 24: mlx-lm's rule")


def test_a_plan_without_a_way_takes_the_fastest_of_the_others() -> None:
    plan = DispatchPlan(way_at=((1, BY_EXPERT), (8, GATHER), (24, BY_EXPERT)), ways=WAYS,
                        timings_ms=((1, (1.0, 2.0, 0.9)), (8, (1.5, 5.0, 1.6)), (24, (3.3, 3.1, 2.9))))
    off = plan.without(BY_EXPERT)
    assert off.ways == (GATHER, SORTED) and off.way_at == ((1, GATHER), (8, GATHER), (24, SORTED))
    assert off.timings_ms == ((1, (1.0, 2.0)), (8, (1.5, 5.0)), (24, (3.3, 3.1)))
    assert off.without(BY_EXPERT) is off


def test_measured_at_build_and_both_ways_give_the_same_bits_on_the_cpu(
    moe_vlm_factory: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Building the text model of the fp32 MoE checkpoint measures the dispatch once (one log line) and gives the
    backbone's and the head's switches the plan; on the CPU every way's calls agree bit for bit at decode and prefill
    sizes, and a whole forward does not change with the plan."""
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    if mx.default_device() != mx.cpu:
        pytest.skip("bitwise agreement is a property of MLX's CPU GatherMM")
    path = moe_vlm_factory("mlx")
    vlm, _ = load(str(path))
    with caplog.at_level(logging.INFO, logger="vllm_mlx_mtp_routing"):
        bundle = build_text_model(vlm, path, json.loads((path / "config.json").read_text()))
    lines = [r.getMessage() for r in caplog.records if "MoE expert dispatch measured" in r.getMessage()]
    assert len(lines) == 1, lines
    model, head = bundle.model, bundle.mtp
    assert head is not None
    switches = [m for root in (model, head) for _, m in root.named_modules() if isinstance(m, DispatchedSwitchGLU)]
    assert len(switches) == len(model.model.layers) + len(head.layers)
    plan = switches[0].plan
    # the smallest sizes first, as many as the time budget allows (all of them on a GPU)
    assert [n for n, _ in plan.way_at] == list(MEASURED_TOKENS[: len(plan.way_at)]) and plan.way_at
    assert all(s.plan is plan for s in switches)

    block = model.model.layers[0].mlp
    k = block.top_k
    for shape in ((1, 1), (4, 1), (4, 2), (8, 2), (2, 40)):
        x = mx.random.normal((*shape, model.args.hidden_size), key=mx.random.key(sum(shape)))
        inds = mx.argpartition(block.gate(x), kth=-k, axis=-1)[..., -k:]
        gathered, *others = (block.switch_mlp.dispatch(x, inds, way) for way in WAYS)
        assert gathered.shape == (*shape, k, model.args.hidden_size)
        assert all(mx.array_equal(gathered, other).item() for other in others), shape

    ids = mx.array([[11, 200, 31, 4, 999, 5]])
    outs = []
    try:
        for way in WAYS:
            set_plan(DispatchPlan(tuple((n, way) for n in MEASURED_TOKENS)), model, head)
            outs.append(model(ids))
    finally:
        set_plan(plan, model, head)
    assert all(mx.array_equal(outs[0], out).item() for out in outs[1:])


def test_a_gpu_measures_every_decode_size_each_compiled_before_it_is_timed(
    moe_vlm_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU each new size's first call compiles kernels: it is made untimed, and the GPU's budget reaches every
    decode size (at 1.5 s an H200 measured only 1-2 tokens of the 35B-A3B shape, so batch 4's verify kept mlx-lm's
    sort)."""
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.kernels import moe_dispatch
    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    path = moe_vlm_factory("mlx")
    vlm, _ = load(str(path))
    bundle = build_text_model(vlm, path, json.loads((path / "config.json").read_text()))
    calls: list[tuple[int, str]] = []
    dispatch = DispatchedSwitchGLU.dispatch

    def counted(self: DispatchedSwitchGLU, x: mx.array, indices: mx.array, way: str) -> mx.array:
        calls.append((indices.shape[0], way))
        return dispatch(self, x, indices, way)

    monkeypatch.setattr(DispatchedSwitchGLU, "dispatch", counted)
    monkeypatch.setattr(moe_dispatch, "on_gpu", lambda: True)
    plan = moe_dispatch.measure(bundle.model, bundle.mtp)
    assert plan is not None and [n for n, _ in plan.way_at] == list(MEASURED_TOKENS)
    layers = min(moe_dispatch.TIMED_LAYERS, len(bundle.model.model.layers))
    # the expert kernel is CUDA's only: elsewhere the other two are timed
    assert plan.ways == ((*WAYS,) if moe_dispatch.on_cuda() else (GATHER, SORTED))
    for n in MEASURED_TOKENS:  # one untimed call each way, then the timed repeats
        assert all(calls.count((n, way)) == layers * (1 + moe_dispatch.REPEATS) for way in plan.ways), n
        assert calls.count((n, BY_EXPERT)) == (0 if BY_EXPERT not in plan.ways else calls.count((n, GATHER))), n
    # the fastest way of each size is the one planned
    assert all(way == plan.ways[ms.index(min(ms))] for (_, way), (_, ms) in zip(plan.way_at, plan.timings_ms))


def test_an_expert_kernel_that_cannot_run_leaves_mlxs_ways_with_a_warning(
    moe_vlm_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The expert kernel is compiled at its first call; where it cannot run (here: MLX's CPU backend asked to run a
    CUDA kernel) start-up goes on with the gather and the sort, and says so once."""
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.kernels import moe_dispatch
    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    if mx.default_device() != mx.cpu:
        pytest.skip("needs a backend without CUDA")
    path = moe_vlm_factory("mlx")
    vlm, _ = load(str(path))
    bundle = build_text_model(vlm, path, json.loads((path / "config.json").read_text()))
    monkeypatch.setattr(moe_dispatch, "on_cuda", lambda: True)
    switch = next(m for _, m in bundle.model.named_modules() if isinstance(m, DispatchedSwitchGLU))
    assert BY_EXPERT in switch.ways(64)
    with caplog.at_level(logging.WARNING, logger="vllm_mlx_mtp_routing"):
        plan = moe_dispatch.measure(bundle.model, bundle.mtp, budget_s=0.2)
    assert plan is not None and plan.ways == (GATHER, SORTED) and BY_EXPERT not in dict(plan.way_at).values()
    assert [r.getMessage() for r in caplog.records if "expert kernel did not run" in r.getMessage()]


def test_the_expert_kernel_is_offered_only_where_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a switch offers the expert kernel for unquantized, bias-free experts whose rows are a multiple of 128
    wide, up to the kernel's pairs; elsewhere only MLX's two ways."""
    import mlx.nn as nn

    from vllm_mlx_mtp_routing.model.kernels import expert_gemv, moe_dispatch

    def switch(input_dims: int = 256, hidden_dims: int = 128, bias: bool = False) -> DispatchedSwitchGLU:
        s = DispatchedSwitchGLU(input_dims, hidden_dims, 4, bias=bias)
        s.train(False)
        return s

    assert switch().ways(8) == (GATHER, SORTED)  # MLX's CPU backend
    monkeypatch.setattr(moe_dispatch, "on_cuda", lambda: True)
    assert switch().ways(8) == WAYS and switch().ways(expert_gemv.MAX_PAIRS) == WAYS
    assert switch().ways(expert_gemv.MAX_PAIRS + 1) == (GATHER, SORTED)
    assert switch(bias=True).ways(8) == (GATHER, SORTED)
    assert switch(input_dims=192).ways(8) == (GATHER, SORTED)  # the gate and up experts' rows
    assert switch(hidden_dims=64).ways(8) == (GATHER, SORTED)  # the down experts' rows
    quantized = switch()
    nn.quantize(quantized, group_size=64, bits=4)
    assert quantized.ways(8) == (GATHER, SORTED)
    training = switch()
    training.train(True)
    assert training.ways(8) == (GATHER, SORTED)
