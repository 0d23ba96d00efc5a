"""One matmul where a layer runs several on the same input: the gated-delta layer's four input projections (qkv, z,
b, a) and an MLP's gate and up (the dense MLPs and the MoE blocks' shared expert).

A decode step is launch-bound on a GPU (docs/benchmarks.md, "Decode loops"): at the 2B shape 78 of its ~650 kernels
are these projections' separate matrix-vector products. The fused weight is the parts' weights (and scales, biases)
concatenated by output row, made once at load; each part's module then holds its arrays as row slices of it, which
MLX keeps as views of the one buffer, so memory is unchanged and every caller of the part modules (mlx-lm's and
mlx-vlm's own calls) reads the same values. Each output is the same dot product as before: bitwise the separate
projections' on the CPU (tests/test_fused_projections.py). The fused module is kept off the module tree (not a
parameter: the model's parameter list, its fingerprint and the VLM's sharing check stay as they were).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..mlx_lm_internals import MLP, swiglu

_FUSED = "_fused_projection"  # the attribute the fused module and its split points are kept under


def fuse(parts: Sequence[nn.Module]) -> tuple[nn.Module, list[int]] | None:
    """A module computing ``parts`` (linear layers of one input) in one call, and the output offsets that split its
    result into theirs; the parts' arrays become views of its arrays. None (nothing changed) unless every part is a
    linear layer of the same class with the same arrays and, quantized, the same quantization."""
    first = parts[0]
    if not isinstance(first, (nn.Linear, nn.QuantizedLinear)) or any(type(p) is not type(first) for p in parts):
        return None
    keys = sorted(k for k, v in first.items() if isinstance(v, mx.array))
    quant = ("group_size", "bits", "mode")
    for p in parts:
        if sorted(k for k, v in p.items() if isinstance(v, mx.array)) != keys:
            return None
        if any(getattr(p, q, None) != getattr(first, q, None) for q in quant):
            return None
        if any(p[k].shape[1:] != first[k].shape[1:] or p[k].dtype != first[k].dtype for k in keys):
            return None
    rows = [p["weight"].shape[0] for p in parts]
    ends = [sum(rows[: i + 1]) for i in range(len(rows))]
    fused = copy.copy(first)
    for key in keys:
        whole = mx.concatenate([p[key] for p in parts], axis=0)
        fused[key] = whole
        for p, start, end in zip(parts, [0, *ends[:-1]], ends):
            p[key] = whole[start:end]
    mx.eval(fused.parameters(), [p.parameters() for p in parts])  # the parts' own buffers are released here
    return fused, ends[:-1]


def project(module: nn.Module, parts: Sequence[str], x: mx.array) -> list[mx.array]:
    """``[module.<part>(x) for part in parts]``: from the fused projection where ``fuse_into`` made one."""
    made = module.__dict__.get(_FUSED)
    if made is None:
        return [getattr(module, p)(x) for p in parts]
    fused, splits = made
    return list(mx.split(fused(x), splits, axis=-1))


def fuse_into(module: nn.Module, parts: Sequence[str]) -> dict[int, mx.array]:
    """Fuse ``module``'s linear layers named ``parts`` (``project`` then runs them as one); returns each replaced array's
    id -> its view, for other holders of the same arrays. Empty where they cannot be fused."""
    layers = [getattr(module, p) for p in parts]
    before = [{k: v for k, v in m.items() if isinstance(v, mx.array)} for m in layers]
    made = fuse(layers)
    if made is None:
        return {}
    object.__setattr__(module, _FUSED, made)  # not a module attribute: nn.Module would list it as a child
    return {id(old): m[k] for m, arrays in zip(layers, before) for k, old in arrays.items()}


def detach(root: nn.Module) -> dict[int, tuple[nn.Module, Any]]:
    """Take the fused projections off the modules under ``root``: they project part by part again, on the same views.
    Returns what ``attach`` puts back (A/B benchmarks and tests run both ways on one model)."""
    made = {}
    for _, m in root.named_modules():
        if _FUSED in m.__dict__:
            made[id(m)] = (m, m.__dict__.pop(_FUSED))
    return made


def attach(made: dict[int, tuple[nn.Module, Any]]) -> None:
    """Put back what ``detach`` took off."""
    for m, fused in made.values():
        object.__setattr__(m, _FUSED, fused)


class FusedMLP(MLP):
    """mlx-lm's MLP (qwen3_next) whose gate and up run as one matmul where ``fuse_into`` made it."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = project(self, ("gate_proj", "up_proj"), x)
        return self.down_proj(swiglu(gate, up))


GATED_DELTA_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def use_fused_projections(model: nn.Module, gated_delta_class: type, engine_class: type,
                          shares: nn.Module | None = None) -> int:
    """Fuse the text model's gated-delta input projections (those layers take ``engine_class``, whose call runs the
    engine's ``gated_delta_layer``, which projects through ``project``) and its MLPs' gate and up (``FusedMLP``), one
    layer at a time; ``shares`` (the VLM's language model, which holds the same arrays) gets each view as it is made,
    so the arrays it replaces are freed layer by layer. Returns how many arrays are now views."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, m in shares.named_modules() if shares is not None else ():
        for k, v in m.items():
            if isinstance(v, mx.array):
                holders.setdefault(id(v), []).append((m, k))

    def swap(views: dict[int, mx.array]) -> int:
        for key, view in views.items():
            for m, k in holders.pop(key, []):
                m[k] = view
        return len(views)

    n = 0
    for layer in model.model.layers:
        lin: Any = getattr(layer, "linear_attn", None)
        if type(lin) in (gated_delta_class, engine_class) and lin.sharding_group is None:
            if made := fuse_into(lin, GATED_DELTA_INPUTS):
                n += swap(made)
                lin.__class__ = engine_class
        for _, m in layer.named_modules():
            if type(m) is MLP and (made := fuse_into(m, ("gate_proj", "up_proj"))):
                n += swap(made)
                m.__class__ = FusedMLP
    return n
