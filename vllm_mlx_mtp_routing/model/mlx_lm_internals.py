"""Every mlx-lm internal this package relies on, reached from here only (written against mlx-lm
0.31.3; re-check each on an upgrade: tests/test_mtp_decode.py pins the gated-delta capture).

- ``mlx_lm.models.gated_delta``: ``compute_g``, ``_gated_delta_step_ops`` (its compiled single
  step) and ``gated_delta_kernel`` (Metal): the verify keeps the recurrent state after every
  position, which the public ``gated_delta_update`` does not return; ``GatedDeltaNet`` (the layer
  whose ``__call__`` backbone.gated_delta_layer mirrors, to run the fused CUDA recurrence).
- The qwen3_5 text model's structure: ``model.model.layers``, ``fa_idx`` / ``ssm_idx`` (which
  cache builds the attention / gated-delta masks), ``layer.is_linear``, ``layer.linear_attn``'s
  projections and sizes, ``model.args``; ``DecoderLayer`` (the MTP head's layer).
- ``mlx_lm.models.cache``: ``_BaseCache`` (the base our batch KV cache derives from),
  ``ArraysCache`` (gated-delta [conv, recurrent] state, batch on axis 0), ``KVCache``.
- ``mlx_lm.models.base``: ``create_attention_mask`` / ``create_ssm_mask``, ``scaled_dot_product_attention``;
  ``Qwen3NextAttention``'s projections, norms and ``rope`` (SpecPrefill rotates kept tokens at their
  own positions; the grouped attention runs its ``__call__`` with the attention call split by row
  length, kernels/grouped_attention.py).
- ``Qwen3NextMLP`` and ``activations.swiglu``: ``FusedMLP`` (kernels/fused_projections.py) mirrors the MLP's
  ``__call__`` with its gate and up in one matmul; ``Qwen3NextSparseMoeBlock``: ``FusedSparseMoeBlock`` mirrors its
  ``__call__`` with the router, the shared expert's gate and its gate and up in one matmul.
- ``mlx_lm.models.switch_layers``: ``SwitchGLU`` (the MoE switch whose ``__call__`` kernels/moe_dispatch.py mirrors
  with the sort chosen per call size) and its ``_gather_sort`` / ``_scatter_unsort``; ``SwitchLinear`` /
  ``QuantizedSwitchLinear`` (experts on the leading axis of every array: kernels/fused_projections.py stacks the
  switch's gate and up experts into one).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache, _BaseCache
from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, gated_delta_kernel, gated_delta_update
from mlx_lm.models.qwen3_5 import DecoderLayer, GatedDeltaNet, TextModel, TextModelArgs
from mlx_lm.models.qwen3_next import (
    Qwen3NextAttention as Attention,
    Qwen3NextMLP as MLP,
    Qwen3NextSparseMoeBlock as SparseMoeBlock,
)
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, _gather_sort, _scatter_unsort

__all__ = [
    "ArraysCache",
    "Attention",
    "BaseCache",
    "DecoderLayer",
    "GatedDeltaNet",
    "KVCache",
    "MLP",
    "QuantizedSwitchLinear",
    "SparseMoeBlock",
    "SwitchGLU",
    "SwitchLinear",
    "TextModel",
    "TextModelArgs",
    "attention_cache_index",
    "compute_g",
    "create_attention_mask",
    "create_ssm_mask",
    "gated_delta_kernel",
    "gated_delta_step",
    "gated_delta_update",
    "gather_sort",
    "scatter_unsort",
    "ssm_cache_index",
    "swiglu",
]

BaseCache = _BaseCache
gated_delta_step = _gated_delta_step_ops
gather_sort = _gather_sort
scatter_unsort = _scatter_unsort


def attention_cache_index(model: Any) -> int:
    """The layer whose cache builds the full-attention mask."""
    return model.model.fa_idx


def ssm_cache_index(model: Any) -> int:
    """The layer whose cache builds the gated-delta (SSM) mask."""
    return model.model.ssm_idx


def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
    """``mlx_lm.models.base.scaled_dot_product_attention`` (quantized KV caches included)."""
    from mlx_lm.models.base import scaled_dot_product_attention as sdpa

    return sdpa(*args, **kwargs)
