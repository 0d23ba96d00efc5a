"""What the text engine allocates per request, for admission: a ``MemoryModel`` built from the
engine's own model and caches (its dtype, its attention and MTP-head layers, its KV pool's block,
its prefill chunk and the drafts its decode strategy verifies per step)."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.nn as nn

from ..admission.memory_model import MemoryModel
from ..model.kernels.device import on_gpu
from .batch_cache import RaggedKVCache


def engine_memory_model(model: nn.Module, *, prefill_step_size: int, head_layers: int, draft_tokens: int) -> MemoryModel:
    """The projection the engine stands behind: a row's KV in the batch's block pool (the MTP
    head's layers included), its gated-delta state, k drafts per verify, and the prefill stage's
    single-sequence caches and working set until the row joins."""
    args: Any = model.args
    config = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    config["mtp_num_hidden_layers"] = head_layers
    dtype = model.model.embed_tokens.weight.dtype
    # Quantized embeddings hold packed integers; activations and KV are then 16-bit.
    dtype_bytes = dtype.size if dtype.size in (2, 4) and "int" not in str(dtype) else 2
    mm = MemoryModel.from_model_config(
        config,
        dtype_bytes=dtype_bytes,
        prefill_step_size=prefill_step_size,
        include_mtp=head_layers > 0,
        draft_tokens=draft_tokens,
        delta_scan_block=0,  # mlx-lm's recurrence, not mlx-vlm's chunked scan
    )
    return dataclasses.replace(mm, kv_block=RaggedKVCache.block, prefill_logits=False, prefill_position_states=not on_gpu())
