"""A Qwen3.5-shaped text model and one-layer MTP head with random weights, built in memory as the engine runs them.

The model is mlx-lm's qwen3_5 ``TextModel`` (dense or MoE, from a ``shapes.PRESETS`` entry), the head the package's
``MTPHead`` bound to it; both take the class swaps ``build_text_model`` gives a loaded checkpoint (``swaps.apply``,
and an MoE model's measured expert dispatch),
so the engine runs them as it would run a real one. Each parameter is its module's own random init cast to the
dtype a few at a time: the float32 init of the whole model never exists at once (35B-A3B: 140 GB). lm_head rows of
``zero_ids`` (ids the tokenizer lacks, its special tokens) are zero, so greedy decoding never emits them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from vllm_mlx_mtp_routing.model.kernels import moe_dispatch, swaps
from vllm_mlx_mtp_routing.model.mlx_lm_internals import TextModel, TextModelArgs
from vllm_mlx_mtp_routing.model.mtp import MTPHead

from .shapes import COMMON

CAST_BYTES = 2 << 30  # float32 init evaluated per group of at most this many bytes


def text_config(shape: dict, layers: int | None = None) -> dict:
    """The mlx-lm text config of a shape, with ``layers`` decoder layers in place of the shape's own."""
    config = {**COMMON, **shape}
    if layers:
        config["num_hidden_layers"] = layers
    if config.get("num_experts"):
        config["model_type"] = "qwen3_5_moe_text"
    return config


def _cast(module: Any, dtype: Any) -> None:
    """Each array of ``module`` replaced by its cast as soon as it is made, evaluated a group at a time: a float32
    init is freed once its cast is evaluated (nothing else holds it)."""
    pending: list[mx.array] = []
    size = 0
    for _, m in module.named_modules():
        for key, v in list(m.items()):
            if not isinstance(v, mx.array) or key == "A_log":  # A_log stays fp32, as in mlx-lm
                continue
            m[key] = v.astype(dtype)
            pending.append(m[key])
            size += v.size * 4
            if size >= CAST_BYTES:
                mx.eval(pending)
                pending, size = [], 0
    mx.eval(pending)


def build(config: dict, dtype: Any, zero_ids: list[int], seed: int = 0) -> tuple[TextModel, MTPHead]:
    """(TextModel, bound MTPHead) with random weights in ``dtype``, the engine's class swaps made."""
    mx.random.seed(seed)
    args = TextModelArgs.from_dict(config)
    model = TextModel(args)
    _cast(model, dtype)
    head = MTPHead(args, 1)
    _cast(head, dtype)
    out = model.model.embed_tokens if args.tie_word_embeddings else model.lm_head
    keep = np.ones((args.vocab_size, 1), dtype=np.float32)
    keep[[i for i in zero_ids if i < args.vocab_size]] = 0.0
    out.weight = out.weight * mx.array(keep).astype(dtype)
    model.train(False)
    head.train(False)
    head.bind(model)
    if swaps.apply(model, head).moe_switches:
        moe_dispatch.measure(model, head)  # as build_text_model does
    mx.eval(model.parameters(), [v for m in (model, head) for mod in m.modules() for v in mod.values()
                                 if isinstance(v, mx.array)])
    return model, head


def parameter_count(module: Any) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))
