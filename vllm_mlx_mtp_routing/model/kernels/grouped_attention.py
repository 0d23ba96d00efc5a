"""Attention over a ragged batch in calls of rows of similar length.

mlx-lm's attention layer reads the whole batch's keys in one call, so every row reads the longest
row's span. Over a ``RaggedKVCache`` this layer asks the cache how to split the rows
(``RaggedKVCache.groups``, length_groups.py) and, where a split pays, runs one attention call per
group over that group's own span: a 16K-token row beside four chats does not make the chats read
16K positions. Everything else is mlx-lm's ``Qwen3NextAttention.__call__`` (mlx-lm 0.31.3), line
for line; a row's queries, keys and mask are the same, and its scores past its own length are
masked in the single call, so its output is the one the single call gives. Its q, k and v projections run as
one matmul where they were fused (fused_projections.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ...text_engine.batch_cache import RaggedKVCache
from ..mlx_lm_internals import Attention, scaled_dot_product_attention
from .fused_projections import ATTENTION_QKV, project


class GroupedAttention(Attention):
    """mlx-lm's attention layer with the call split by row length over a ``RaggedKVCache``, and its q, k and v
    projections as one matmul where ``fused_projections`` made one; the class every attention layer of the text model
    and its MTP head takes (swaps.py)."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        q, k, v = project(self, ATTENTION_QKV, x)
        queries, gate = mx.split(q.reshape(B, L, self.num_attention_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        queries = self.q_norm(queries).transpose(0, 2, 1, 3)
        keys = self.k_norm(k.reshape(B, L, self.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        values = v.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        if cache is None:
            queries, keys = self.rope(queries), self.rope(keys)
        else:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
        plan = cache.groups(L) if isinstance(cache, RaggedKVCache) else None
        if plan is None or isinstance(mask, str):
            if cache is not None:
                keys, values = cache.update_and_fetch(keys, values)
            output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        else:
            cache.write(keys, values)
            calls, inverse = plan
            outputs = []
            for group in calls:
                k_rows, v_rows = cache.read_rows(group)
                m = None if mask is None else mask[group.index][..., : group.span]
                outputs.append(mx.fast.scaled_dot_product_attention(queries[group.index], k_rows, v_rows,
                                                                    scale=self.scale, mask=m))
            output = mx.concatenate(outputs)[inverse]
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output * mx.sigmoid(gate))
