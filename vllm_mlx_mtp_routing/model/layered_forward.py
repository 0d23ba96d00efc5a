"""A prefill chunk's forward that may stop between decoder layers and go on in a later engine step.

A chunk's numbers depend on its positions (where it starts and ends), not on when its layers run: the layers here are
the same calls, in the same order, on the same inputs as one whole forward (mlx-lm's qwen3_5 decoder stack, or the
media prefill's with the VLM's M-RoPE rotation), so a chunk run in pieces leaves bitwise the caches one forward leaves.
That lets the engine keep large chunks (the host's size, no per-chunk tax on a long prompt) and still bound how long
one step's prefill holds up the running streams: it runs as many layers of a chunk as fit the step.

The masks are made once, from the caches as they were before the chunk (a piece that starts past the first attention
layer would otherwise see that layer's cache already holding the chunk).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .mlx_lm_internals import ArraysCache, attention_cache_index, create_attention_mask, create_ssm_mask, ssm_cache_index
from .rotated_attention import rotated_layer


@dataclass
class LayerProgress:
    """A chunk ``prompt[start:end]`` whose forward has run its layers before ``next_layer``: ``hidden`` is what
    enters that layer."""

    start: int
    end: int
    tokens: mx.array  # [1, n] the chunk's ids (the MTP head's pairs read them)
    hidden: mx.array  # [1, n, H]
    next_layer: int
    attention_mask: Any
    ssm_mask: Any
    position_ids: mx.array | None = None  # [3, 1, n]: a media chunk's M-RoPE positions; None: text positions
    # Per layer, its cache before the chunk (a gated-delta layer's arrays, an attention layer's key count): ``rewind``
    before: list[Any] = field(default_factory=list)


def begin(model: nn.Module, start: int, tokens: mx.array, cache: Sequence[Any], embeddings: mx.array | None = None,
          position_ids: mx.array | None = None) -> LayerProgress:
    """A chunk's forward before its first layer: its input embeddings (the tokens' own, or ``embeddings`` with a
    media prompt's features in place) and its masks."""
    h = model.model.embed_tokens(tokens) if embeddings is None else embeddings
    before = [list(c.state) if isinstance(c, ArraysCache) else c.offset for c in cache]  # references: no copies
    return LayerProgress(start, start + tokens.shape[1], tokens, h, 0,
                         create_attention_mask(h, cache[attention_cache_index(model)]),
                         create_ssm_mask(h, cache[ssm_cache_index(model)]), position_ids, before)


def rewind(progress: LayerProgress, cache: Sequence[Any]) -> None:
    """Put the layers the chunk has run back to where they were before it, so the caches again hold the prompt up to
    ``progress.start`` alone (a snapshot of them is then whole)."""
    for c, was in zip(cache[: progress.next_layer], progress.before):
        if isinstance(c, ArraysCache):
            c.state = list(was)
        else:
            c.trim(c.offset - was)


def run_layers(model: nn.Module, progress: LayerProgress, cache: Sequence[Any], stop: int,
               rotaries: Sequence[Any] | None = None) -> None:
    """Run layers ``progress.next_layer`` up to ``stop`` (lazily: the caller evaluates)."""
    layers = model.model.layers
    h = progress.hidden
    for i in range(progress.next_layer, stop):
        layer, c = layers[i], cache[i]
        if layer.is_linear:
            h = layer(h, mask=progress.ssm_mask, cache=c)
        elif progress.position_ids is None:
            h = layer(h, mask=progress.attention_mask, cache=c)
        else:  # the VLM's own rotary module of this layer, at its M-RoPE positions
            assert rotaries is not None  # a media chunk is only run with the vision parts
            rotate = functools.partial(rotaries[i].apply_rotary, position_ids=progress.position_ids, unsqueeze_dim=1)
            h = rotated_layer(layer, h, c, rotate)
    progress.hidden, progress.next_layer = h, stop


def head_input(model: nn.Module, progress: LayerProgress, hidden_state_mode: str) -> mx.array:
    """After the last layer: the hidden state the MTP head reads (post-norm, or pre-norm)."""
    return progress.hidden if hidden_state_mode == "pre_norm" else model.model.norm(progress.hidden)


def layer_kinds(model: nn.Module) -> tuple[bool, ...]:
    """Per decoder layer: is it a full-attention layer (its cost grows with the position)?"""
    return tuple(not layer.is_linear for layer in model.model.layers)
