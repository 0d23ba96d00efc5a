"""mlx-lm's gated attention layer (``Qwen3NextAttention``: q/k norms, sigmoid gate) with the rotation given by the caller.

mlx-lm rotates a forward's tokens at consecutive positions from its cache's offset. A sparse prefill (per-token
positions) and a media prefill (the VLM's M-RoPE positions) rotate otherwise; everything else of the layer is the
module's own, its keys appended to the given single-sequence cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .mlx_lm_internals import create_attention_mask, scaled_dot_product_attention

# (queries, keys) [1, H, L, D] each -> the two rotated
Rotate = Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]


def rotated_attention(attn: nn.Module, x: mx.array, cache: Any, rotate: Rotate) -> mx.array:
    """The attention over x [1, L, D], queries and keys rotated by ``rotate``."""
    B, L, _ = x.shape
    q, gate = mx.split(attn.q_proj(x).reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, L, -1)
    q = attn.q_norm(q).transpose(0, 2, 1, 3)
    k = attn.k_norm(attn.k_proj(x).reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    q, k = rotate(q, k)
    # The keys held are the prompt's in position order, so "causal" over them is the right mask.
    mask = create_attention_mask(x, cache)
    k, v = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate))


def rotated_layer(layer: nn.Module, h: mx.array, cache: Any, rotate: Rotate) -> mx.array:
    """A full-attention decoder layer (attention, then MLP, each with its residual) with ``rotate``."""
    h = h + rotated_attention(layer.self_attn, layer.input_layernorm(h), cache, rotate)
    return h + layer.mlp(layer.post_attention_layernorm(h))
