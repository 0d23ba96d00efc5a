"""The gated-delta decoder layer's one-token step as one compiled graph.

A decode step runs each of the text model's gated-delta decoder layers ([GDN x3, attention] x N: three of every four
layers) on one token per row: about a hundred small ops a layer (norms, projections, the conv window, the gates, one
recurrence step, the gated norm, the MLP), each a separate kernel, and each a few microseconds of Python to build.
Compiled (``mx.compile``, traced once per batch size) its elementwise ops fuse and the graph is built once: fewer
kernels and less Python per step. The layer's inputs are its hidden state and its cache's [conv, recurrent] state;
its weights are constants of the graph (inference never changes them). The arithmetic is mlx-lm's
``DecoderLayer.__call__``, the same ops in the same order: outputs are bitwise those of the uncompiled layer on the
CPU (tests/test_compiled_decode.py).

The MTP verify's layer (backbone.backbone_forward with capture: the recurrent state after each position kept) runs
compiled the same way, one graph per layer and recurrence (``verify_step``). A mask, a cache with per-row
``lengths`` (mlx-lm's batch prefill) or a prompt chunk run mlx-lm's own call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..mlx_lm_internals import ArraysCache, DecoderLayer
from .retype import retype

Step = Callable[[mx.array, mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]
# (the gated-delta layer, its normed input, conv state, recurrent state) -> (output, conv window input, final state,
# the state after each position as one [B, S, ...] array or one array a position): backbone._layer_core with capture
Core = Callable[[Any, mx.array, mx.array, mx.array], tuple[mx.array, mx.array, mx.array, Any]]
VerifyStep = Callable[[mx.array, mx.array, mx.array], tuple[mx.array, mx.array, mx.array, Any]]


def layer_tail(layer: DecoderLayer, x: mx.array, r: mx.array) -> mx.array:
    """What follows a decoder layer's mixer (its output ``r``, its input ``x``): the residual, the post-attention norm,
    the MLP, the residual; mlx-lm's ``DecoderLayer.__call__`` from its residual on."""
    h = x + r
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _layer_step(layer: DecoderLayer, x: mx.array, conv_state: mx.array, state: mx.array) -> tuple[mx.array, ...]:
    cache = ArraysCache(size=2)
    cache[0], cache[1] = conv_state, state
    out = DecoderLayer.__call__(layer, x, None, cache)
    return out, cache[0], cache[1]


def _verify_layer(layer: DecoderLayer, core: Core, h: mx.array, conv_state: mx.array,
                  state: mx.array) -> tuple[mx.array, mx.array, mx.array, Any]:
    r, conv_input, final, states = core(layer.linear_attn, layer.input_layernorm(h), conv_state, state)
    return layer_tail(layer, h, r), conv_input, final, states


def plain_cache(cache: Any) -> bool:
    """A gated-delta cache holding state, without per-row lengths or padding: what the compiled steps take."""
    return (isinstance(cache, ArraysCache) and cache[0] is not None and cache[1] is not None and cache.lengths is None
            and cache.left_padding is None)


class CompiledDecoderLayer(DecoderLayer):
    """mlx-lm's gated-delta decoder layer whose one-token step runs compiled; the class the text model's gated-delta
    layers take (swaps.py)."""

    _step: Step | None

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if x.shape[1] != 1 or mask is not None or self.training or not plain_cache(cache):
            return super().__call__(x, mask, cache)
        step = self.__dict__.get("_step")
        if step is None:
            step = mx.compile(functools.partial(_layer_step, self))
            object.__setattr__(self, "_step", step)  # not a module attribute: nn.Module would list it
        out, cache[0], cache[1] = step(x, cache[0], cache[1])
        cache.advance(1)
        return out

    def verify_step(self, h: mx.array, conv_state: mx.array, state: mx.array,
                    core: Core) -> tuple[mx.array, mx.array, mx.array, Any]:
        """The verify's whole layer (norms, the gated-delta layer through ``core``, the MLP, the residuals) compiled,
        one graph per ``core`` (the active recurrence) -> (output, conv window input, final state, every state)."""
        steps: dict[Core, VerifyStep] = self.__dict__.setdefault("_verify_steps", {})
        step = steps.get(core)
        if step is None:
            step = steps[core] = mx.compile(functools.partial(_verify_layer, self, core))
        return step(h, conv_state, state)


def retrace(layers: Any) -> None:
    """Drop the one-token steps and verify steps these layers traced: their next call traces again (a switch a traced
    graph baked in, such as causal_conv.conv_step_devices or a fused projection, then takes effect)."""
    for layer in layers:
        for traced in ("_step", "_verify_steps"):
            layer.__dict__.pop(traced, None)


def use_compiled_decode(model: Any) -> int:
    """Give the text model's gated-delta decoder layers the compiled one-token step; how many changed."""
    return retype(model.model.layers, DecoderLayer, CompiledDecoderLayer, lambda layer: layer.is_linear)
