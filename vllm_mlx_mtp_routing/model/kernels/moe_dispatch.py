"""How mlx-lm's MoE switch (``SwitchGLU``) dispatches a call's (token, expert) pairs: chosen by the call's size from
times measured on the loaded model, not by mlx-lm's fixed threshold.

mlx-lm 0.31.3 sorts a call's pairs by expert once it holds 64 of them and multiplies them grouped by expert
(``sorted_indices``; on CUDA a grouped GEMM over every expert); below that each pair is its own matrix-vector product
(a gather). At 8 experts a token the threshold splits the calls of one batch size: at 4 rows the plain step's [4, 1]
call (32 pairs) gathers while the MTP verify's [4, 2] call (64) sorts, whichever is faster for each. On CUDA a third
way reads each expert's weights once for all the call's pairs of it (expert_gemv.py), with the gather's bits. Here
``DispatchedSwitchGLU`` (the class swaps.py gives every ``SwitchGLU``) takes the way its ``DispatchPlan`` names for the
call's number of tokens; ``measure`` times every way the switches can take on the model's own MoE layers at every token
count a decode call has (up to ``MEASURED_TOKENS``' largest, within a time budget) and keeps the fastest of each.
Larger calls (prefill chunks), sizes left unmeasured and an unmeasured plan follow mlx-lm's rule. Whichever way, each
pair's product is the same arithmetic on MLX's CPU backend (its GatherMM multiplies pair by pair and ignores the sort),
so outputs there do not depend on the choice.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..mlx_lm_internals import SwitchGLU, gather_sort, scatter_unsort
from . import expert_gemv
from .device import on_cuda, on_gpu
from .fused_projections import fused_of
from .retype import modules_of, retype

logger = logging.getLogger(__name__)

MLX_LM_SORT_PAIRS = 64  # mlx-lm 0.31.3's SwitchGLU: sort from this many (token, expert) pairs
# Token counts of a decode call (rows x (1 + drafts)) timed at start; a call of n tokens takes the way measured at
# the smallest of these >= n.
MEASURED_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
TIMED_LAYERS = 8  # MoE layers per timed call (their switches in one graph, as in a step)
REPEATS = 3
# At start. A GPU compiles kernels at each new size's first call (untimed, but on the clock), so it needs more to reach
# every size; the CPU's stays small.
MEASURE_BUDGET_S = {"cpu": 1.5, "gpu": 20.0}

GATHER = "gather"  # each pair its own matrix-vector product
SORTED = "sorted"  # mlx-lm's sort: pairs grouped by expert, multiplied as a grouped matrix product
BY_EXPERT = "by_expert"  # expert_gemv.py: each expert's weights read once for its pairs (CUDA)
WAYS = (GATHER, SORTED, BY_EXPERT)


@dataclass(frozen=True)
class DispatchPlan:
    """The way (one of ``WAYS``) a call takes by its token count: ``way_at`` holds (at most this many tokens, way) in
    ascending order; a call past the last, or any call of a plan without any, follows mlx-lm's rule."""

    way_at: tuple[tuple[int, str], ...] = ()
    ways: tuple[str, ...] = ()  # the ways timed
    timings_ms: tuple[tuple[int, tuple[float, ...]], ...] = ()  # (tokens, ms of each of ``ways``) over the timed layers

    def way(self, tokens: int, pairs: int) -> str:
        for bound, way in self.way_at:
            if tokens <= bound:
                return way
        return SORTED if pairs >= MLX_LM_SORT_PAIRS else GATHER

    def without(self, way: str) -> DispatchPlan:
        """The plan had ``way`` not been timed: each measured size takes the fastest of the other ways."""
        if way not in self.ways:
            return self
        keep = [i for i, w in enumerate(self.ways) if w != way]
        way_at = tuple((n, self.ways[min(keep, key=lambda i: ms[i])]) for n, ms in self.timings_ms)
        timings = tuple((n, tuple(ms[i] for i in keep)) for n, ms in self.timings_ms)
        return DispatchPlan(way_at, tuple(self.ways[i] for i in keep), timings)

    def describe(self) -> str:
        if not self.way_at:
            return f"mlx-lm's rule (sort from {MLX_LM_SORT_PAIRS} pairs)"
        runs: list[tuple[str, int, int]] = []
        lo = 1
        for bound, way in self.way_at:
            if runs and runs[-1][0] == way:
                runs[-1] = (way, runs[-1][1], bound)
            else:
                runs.append((way, lo, bound))
            lo = bound + 1
        return ", ".join(f"{w} at {a}-{b} tokens" if a != b else f"{w} at {a}"
                         for w, a, b in runs) + f"; past {self.way_at[-1][0]}: mlx-lm's rule"


MLX_LM = DispatchPlan()


class DispatchedSwitchGLU(SwitchGLU):
    """mlx-lm's ``SwitchGLU`` (mlx-lm 0.31.3's ``__call__``, line for line) with the way decided by ``plan``; a call
    that gathers does the gate and up experts in one where they were fused (fused_projections.py)."""

    plan: DispatchPlan = MLX_LM  # the class's: mlx-lm's rule until measure() sets the instance's

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self.dispatch(x, indices, self.plan.way(indices.size // indices.shape[-1], indices.size))

    def ways(self, pairs: int) -> tuple[str, ...]:
        """The ways this switch can take for a call of ``pairs`` pairs."""
        return WAYS if self._by_expert_serves(pairs) else (GATHER, SORTED)

    def _by_expert_serves(self, pairs: int) -> bool:
        parts = (self.gate_proj, self.up_proj, self.down_proj)
        # mlx-lm's or mlx-vlm's SwitchLinear, unquantized (a quantized one holds scales) and without a bias
        return (on_cuda() and not self.training and all("scales" not in m and "bias" not in m for m in parts)
                and all(expert_gemv.serves(m["weight"], pairs) for m in parts))

    def dispatch(self, x: mx.array, indices: mx.array, way: str) -> mx.array:
        if way == BY_EXPERT and self._by_expert_serves(indices.size) and x.dtype == self.down_proj["weight"].dtype:
            return self._by_expert(x, indices)
        x = mx.expand_dims(x, (-2, -3))
        idx = indices
        inv_order = None
        grouped = way == SORTED
        if grouped:
            x, idx, inv_order = gather_sort(x, indices)
        if self.training:
            idx = mx.stop_gradient(idx)
        fused = fused_of(self)
        if fused is not None and not grouped:
            # gate's experts then up's, stacked (fused_projections.py): one gather over each pair's two experts
            stacked, (experts,) = fused
            k = idx.shape[-1]
            both = stacked(x, mx.concatenate([idx, idx + experts], axis=-1))
            x_gate, x_up = both[..., :k, :, :], both[..., k:, :, :]
        else:
            x_up = self.up_proj(x, idx, sorted_indices=grouped)
            x_gate = self.gate_proj(x, idx, sorted_indices=grouped)
        x = self.down_proj(self.activation(x_up, x_gate), idx, sorted_indices=grouped)
        if grouped:
            x = scatter_unsort(x, inv_order, indices.shape)
        return x.squeeze(-2)

    def _by_expert(self, x: mx.array, indices: mx.array) -> mx.array:
        idx = indices.reshape(-1, indices.shape[-1])  # a view: argpartition's slice keeps its row stride
        x = x.reshape(-1, x.shape[-1])
        fused = fused_of(self)
        if fused is not None:
            both = expert_gemv.expert_gemv(x, fused[0]["weight"], idx, sets=2)  # gate's experts then up's
            x_gate, x_up = both[:, 0], both[:, 1]
        else:
            x_gate = expert_gemv.expert_gemv(x, self.gate_proj["weight"], idx)[:, 0]
            x_up = expert_gemv.expert_gemv(x, self.up_proj["weight"], idx)[:, 0]
        y = expert_gemv.expert_gemv(self.activation(x_up, x_gate), self.down_proj["weight"], idx, per_pair=True)
        return y.reshape(*indices.shape, y.shape[-1])


def _switches(*roots: nn.Module | None) -> Iterator[nn.Module]:
    for root in roots:
        if root is not None:
            for _, m in root.named_modules():
                if isinstance(m, DispatchedSwitchGLU):
                    yield m


def use_dispatched_switch(module: nn.Module) -> int:
    """Give every mlx-lm ``SwitchGLU`` under ``module`` the dispatched call (mlx-lm's rule until measured); how many."""
    return retype(modules_of(module), SwitchGLU, DispatchedSwitchGLU)


def plan_of(model: nn.Module) -> DispatchPlan | None:
    """The plan ``model``'s MoE switches take (None for a model without any)."""
    return next((m.plan for m in _switches(model)), None)


def set_plan(plan: DispatchPlan, *roots: nn.Module | None) -> None:
    for m in _switches(*roots):
        m.plan = plan


def _fastest_ms(fn: Callable[[], None]) -> float:
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t))
    return min(times)  # a short call's least disturbed run


def measure(model: nn.Module, head: nn.Module | None = None, budget_s: float | None = None) -> DispatchPlan | None:
    """Time every way on up to ``TIMED_LAYERS`` of the model's MoE blocks at each of ``MEASURED_TOKENS`` in turn (inputs
    random, routed by each block's own router) until ``budget_s`` is spent, give the model's and the head's switches
    the plan of the fastest, and return it; None for a model without MoE blocks. Sizes the budget left unmeasured
    follow mlx-lm's rule (MLX's CPU backend, slow at this, measures the smallest decode calls only). On a GPU each size
    is called every way once before it is timed, so its kernels' compilation for a new size is not what is compared."""
    blocks = [layer.mlp for layer in model.model.layers if isinstance(getattr(layer.mlp, "switch_mlp", None), DispatchedSwitchGLU)]
    if not blocks:
        return None
    blocks = blocks[:TIMED_LAYERS]
    H = model.args.hidden_size
    dtype = model.model.norm.weight.dtype  # the activations' (a quantized router's weight is packed integers)
    k = blocks[0].top_k

    def inputs(n: int) -> tuple[mx.array, list[mx.array]]:
        x = mx.random.normal((n, H), key=mx.random.key(n)).astype(dtype)
        routed = [mx.argpartition(blk.gate(x), kth=-k, axis=-1)[..., -k:] for blk in blocks]
        mx.eval(x, routed)
        return x, routed

    ways = [w for w in WAYS if all(w in blk.switch_mlp.ways(MEASURED_TOKENS[-1] * k) for blk in blocks)]

    def call(x: mx.array, routed: list[mx.array], way: str) -> None:
        mx.eval([blk.switch_mlp.dispatch(x, inds, way) for blk, inds in zip(blocks, routed)])

    gpu = on_gpu()
    if budget_s is None:
        budget_s = MEASURE_BUDGET_S["gpu" if gpu else "cpu"]
    first = inputs(MEASURED_TOKENS[0])
    for way in list(ways):  # kernels compiled and planned before the clock starts
        try:
            call(*first, way)
        except Exception as e:  # noqa: BLE001 - MLX raises RuntimeError or ValueError from the JIT
            if way != BY_EXPERT:
                raise
            # the package's own kernel, built at its first call: a toolchain that cannot build it keeps MLX's ways
            logger.warning("TextModel: the MoE expert kernel did not run (%s); the switch gathers or sorts", e)
            ways.remove(way)
    way_at, timings = [], []
    deadline = time.perf_counter() + budget_s
    for n in MEASURED_TOKENS:
        if time.perf_counter() > deadline:
            break
        x, routed = inputs(n)
        if gpu and n != MEASURED_TOKENS[0]:
            for way in ways:  # this size's kernels compiled before it is timed
                call(x, routed, way)
        ms = [_fastest_ms(functools.partial(call, x, routed, way)) for way in ways]
        way_at.append((n, ways[ms.index(min(ms))]))
        timings.append((n, tuple(round(t, 4) for t in ms)))
    plan = DispatchPlan(tuple(way_at), tuple(ways), tuple(timings))
    set_plan(plan, model, head)
    logger.info("TextModel: MoE expert dispatch measured on %d of its MoE layers: %s", len(blocks), plan.describe())
    return plan
