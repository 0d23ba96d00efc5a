"""Full-attention decoder layers with few-token queries run as single-token queries.

MLX's CUDA backend (0.32.4) sends attention with a multi-token query to cuDNN, which builds a plan
per shape: a [B, k+1] verify step or an MTP head step at a batch size or KV capacity not seen
before costs ~190 ms once (benchmarks/gpu_step_trace.py). A single-token query takes MLX's own
vector kernel, which needs no plan. Attention is per query, so the L query positions of a short
query fold into the head axis: [B, Hq, L, D] becomes [B, Hq * L, 1, D], every group of heads that
shares a KV head growing from Hq / Hkv to Hq / Hkv * L queries, each with its own mask row.

``plans_attention_per_shape`` says where that is needed (it also makes ``RaggedKVCache`` show
attention its whole buffer, so the KV length changes every 256 tokens rather than every token).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn

MAX_FOLDED_QUERY = 8  # verify and MTP-head steps are k + 1 <= 8 tokens; prefill chunks are not folded


def plans_attention_per_shape() -> bool:
    """MLX's CUDA backend runs multi-token-query attention through cuDNN, planned per shape."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def folded_sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` for [B, Hq, L, D] queries and a boolean
    [B, 1, L, T] mask, computed as L * Hq single-token queries."""
    B, Hq, L, D = queries.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    rep = Hq // Hkv
    # Heads h = kv * rep + r (MLX's grouping); the folded head kv * rep * L + r * L + l.
    q = queries.reshape(B, Hq * L, 1, D)
    m = mx.broadcast_to(mask.reshape(B, 1, 1, L, T), (B, Hkv, rep, L, T)).reshape(B, Hq * L, 1, T)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=m)
    return out.reshape(B, Hq, L, -1)


def _attention(attn: nn.Module, x: mx.array, mask: mx.array, cache: Any) -> mx.array:
    """mlx-lm 0.31.3 ``Qwen3NextAttention.__call__`` (the qwen3_5 full-attention layer; its
    attribute names are mlx-lm internals) with ``folded_sdpa``."""
    B, L, _ = x.shape
    queries, gate = mx.split(attn.q_proj(x).reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, L, -1)
    keys, values = attn.k_proj(x), attn.v_proj(x)
    queries = attn.q_norm(queries).transpose(0, 2, 1, 3)
    keys = attn.k_norm(keys.reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries = attn.rope(queries, offset=cache.offset)
    keys = attn.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    out = folded_sdpa(queries, keys, values, attn.scale, mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate))


def attention_layer(layer: nn.Module, x: mx.array, mask: Any, cache: Any, fold: bool) -> mx.array:
    """A qwen3_5 full-attention ``DecoderLayer`` on x; with ``fold``, a short query with an array
    mask and a cache runs as single-token queries."""
    if not (fold and cache is not None and isinstance(mask, mx.array) and 1 < x.shape[1] <= MAX_FOLDED_QUERY):
        return layer(x, mask=mask, cache=cache)
    h = x + _attention(layer.self_attn, layer.input_layernorm(x), mask, cache)
    return h + layer.mlp(layer.post_attention_layernorm(h))
