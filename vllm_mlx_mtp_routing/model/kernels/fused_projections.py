"""One matmul where a layer runs several on the same input: the gated-delta layer's four input projections (qkv, z,
b, a), the attention layer's q (with its gate), k and v, an MLP's gate and up, the MoE block's router with its shared
expert's gate and that expert's gate and up, and the MoE switch's gate and up experts (one gather over both).

A decode step is launch-bound on a GPU (docs/benchmarks.md, "Decode loops"): at the 2B shape 78 of its ~650 kernels
are these projections' separate matrix-vector products. The fused weight is the parts' weights (and scales, biases)
concatenated on their leading axis (a linear layer's output rows, a switch's experts), made once at load; each part's
module then holds its arrays as slices of it, which MLX keeps as views of the one buffer, so memory is unchanged and
every caller of the part modules (mlx-lm's and mlx-vlm's own calls) reads the same values. Each output is the same
dot product as before: bitwise the separate projections' on the CPU (tests/test_fused_projections.py). The fused
module is kept off the module tree (not a parameter: the model's parameter list, its fingerprint and the VLM's
sharing check stay as they were).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..mlx_lm_internals import MLP, QuantizedSwitchLinear, SparseMoeBlock, SwitchLinear, swiglu

_FUSED = "_fused_projection"  # the attribute the fused module and its split points are kept under
FUSABLE = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear)  # and their subclasses


def fuse(parts: Sequence[nn.Module]) -> tuple[nn.Module, list[int]] | None:
    """A module computing ``parts`` (linear layers of one input, or switch layers) in one call, and where each part after
    the first starts on the leading axis (a linear layer's outputs, a switch's experts); the parts' arrays become views
    of its arrays. None (nothing changed) unless every part has the same class, the same arrays and, quantized, the
    same quantization."""
    first = parts[0]
    if not isinstance(first, FUSABLE) or any(type(p) is not type(first) for p in parts):
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


def part_of(module: nn.Module, name: str) -> nn.Module:
    """``module``'s layer ``name``; a dotted name reaches into a child (``"shared_expert.up_proj"``)."""
    for attr in name.split("."):
        module = getattr(module, attr)
    return module


def project(module: nn.Module, parts: Sequence[str], x: mx.array) -> list[mx.array]:
    """``[module.<part>(x) for part in parts]``: from the fused projection where ``fuse_into`` made one."""
    made = module.__dict__.get(_FUSED)
    if made is None:
        return [part_of(module, p)(x) for p in parts]
    fused, splits = made
    return list(mx.split(fused(x), splits, axis=-1))


def fused_of(module: nn.Module) -> tuple[nn.Module, list[int]] | None:
    """The fused module ``fuse_into`` gave ``module`` and where its parts start, or None."""
    return module.__dict__.get(_FUSED)


def fuse_into(module: nn.Module, parts: Sequence[str]) -> dict[int, mx.array]:
    """Fuse ``module``'s layers named ``parts`` (``project`` or ``fused_of`` then runs them as one); returns each
    replaced array's id -> its view, for other holders of the same arrays. Empty where they cannot be fused."""
    layers = [part_of(module, p) for p in parts]
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


class FusedSparseMoeBlock(SparseMoeBlock):
    """mlx-lm's MoE block (qwen3_next) whose router, shared expert gate and shared expert's gate and up run as one
    matmul where ``fuse_into`` made it: two launches fewer a layer than the router, the gate and the fused MLP."""

    def __call__(self, x: mx.array) -> mx.array:
        if self.sharding_group is not None or fused_of(self) is None:
            return super().__call__(x)
        gates, shared_gate, gate, up = project(self, MOE_INPUTS, x)
        gates = mx.softmax(gates, axis=-1, precise=True)
        k = self.top_k
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, inds)
        y = (y * scores[..., None]).sum(axis=-2)
        shared_y = self.shared_expert.down_proj(swiglu(gate, up))
        return y + mx.sigmoid(shared_gate) * shared_y


GATED_DELTA_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
MOE_INPUTS = ("gate", "shared_expert_gate", "shared_expert.gate_proj", "shared_expert.up_proj")
GATE_UP = ("gate_proj", "up_proj")
ATTENTION_QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class Fusion:
    """Modules of class ``of`` (exactly) whose ``parts`` run as one; they take the class ``becomes``, whose call
    projects through ``project`` (or ``fused_of``)."""

    of: type
    parts: tuple[str, ...]
    becomes: type
    when: Callable[[Any], bool] | None = None


def use_fused_projections(model: nn.Module, fusions: Sequence[Fusion], shares: nn.Module | None = None) -> int:
    """Make ``fusions`` in the text model, one layer at a time; ``shares`` (the VLM's language model, which holds the
    same arrays) gets each view as it is made, so the arrays it replaces are freed layer by layer. Returns how many
    arrays are now views."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, m in shares.named_modules() if shares is not None else ():
        for k, v in m.items():
            if isinstance(v, mx.array):
                holders.setdefault(id(v), []).append((m, k))

    n = 0
    taken: set[int] = set()  # layers already a part of a fusion (a block's, visited before its children's)
    for layer in model.model.layers:
        for _, m in layer.named_modules():
            f = next((f for f in fusions if type(m) is f.of and (f.when is None or f.when(m))), None)
            if f is None or any(id(part_of(m, p)) in taken for p in f.parts):
                continue
            if not (views := fuse_into(m, f.parts)):
                continue
            taken.update(id(part_of(m, p)) for p in f.parts)
            for key, view in views.items():
                for holder, k in holders.pop(key, []):
                    holder[k] = view
            n += len(views)
            m.__class__ = f.becomes
    return n
