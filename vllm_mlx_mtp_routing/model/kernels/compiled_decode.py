"""The gated-delta decoder layer's one-token step as one compiled graph.

A decode step runs each of the text model's gated-delta decoder layers ([GDN x3, attention] x N: three of every four
layers) on one token per row: about a hundred small ops a layer (norms, projections, the conv window, the gates, one
recurrence step, the gated norm, the MLP), each a separate kernel, and each a few microseconds of Python to build.
Compiled (``mx.compile``, traced once per batch size) its elementwise ops fuse and the graph is built once: fewer
kernels and less Python per step. The layer's inputs are its hidden state and its cache's [conv, recurrent] state;
its weights are constants of the graph (inference never changes them). The arithmetic is mlx-lm's
``DecoderLayer.__call__``, the same ops in the same order: outputs are bitwise those of the uncompiled layer on the
CPU (tests/test_compiled_decode.py).

Only the plain one-token step takes it: a mask, a cache with per-row ``lengths`` (mlx-lm's batch prefill), a
prompt chunk or the MTP verify (backbone.py) run mlx-lm's own call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..mlx_lm_internals import ArraysCache, DecoderLayer

Step = Callable[[mx.array, mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]


def _layer_step(layer: DecoderLayer, x: mx.array, conv_state: mx.array, state: mx.array) -> tuple[mx.array, ...]:
    cache = ArraysCache(size=2)
    cache[0], cache[1] = conv_state, state
    out = DecoderLayer.__call__(layer, x, None, cache)
    return out, cache[0], cache[1]


class CompiledDecoderLayer(DecoderLayer):
    """mlx-lm's gated-delta decoder layer whose one-token step runs compiled; the class the text model's gated-delta
    layers take (swaps.py)."""

    _step: Step | None

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if (x.shape[1] != 1 or mask is not None or self.training or not isinstance(cache, ArraysCache)
                or cache[0] is None or cache[1] is None or cache.lengths is not None or cache.left_padding is not None):
            return super().__call__(x, mask, cache)
        step = self.__dict__.get("_step")
        if step is None:
            step = mx.compile(functools.partial(_layer_step, self))
            object.__setattr__(self, "_step", step)  # not a module attribute: nn.Module would list it
        out, cache[0], cache[1] = step(x, cache[0], cache[1])
        cache.advance(1)
        return out


def use_compiled_decode(model: Any) -> int:
    """Give the text model's gated-delta decoder layers the compiled one-token step; how many changed."""
    n = 0
    for layer in model.model.layers:
        if type(layer) is DecoderLayer and layer.is_linear:
            layer.__class__ = CompiledDecoderLayer
            n += 1
    return n
