"""Every in-place class swap on mlx-lm's modules, and when each is made.

The text model keeps the modules mlx-lm and mlx-vlm built (their parameters are the VLM's own arrays); where the
package runs a kernel of its own, a module's class is swapped for a subclass that calls it, parameters untouched:
- ``GatedDeltaNet`` -> ``backbone.FusedGatedDeltaNet``: the gated-delta layer's conv, gates and recurrence as the package's
  kernels (gated_delta_layer.py, recurrence.py). CUDA only.
- ``nn.Linear`` -> ``skinny_matmul.SkinnyLinear``: the few-row matmul. CUDA only; quantized layers keep theirs.
- ``Attention`` -> ``grouped_attention.GroupedAttention``: a ragged batch's attention split by row length. Every
  device.
- mlx-lm's and mlx-vlm's ``SwitchLinear`` -> ``cpu_experts.Float32SwitchLinear``: 16-bit MoE experts multiplied in
  float32, which MLX's CPU GatherMM needs. CPU only; the VLM's own language model takes it too (the host's path).
- ``GatedDeltaNet`` -> ``backbone.FusedGatedDeltaNet`` and mlx-lm's ``MLP`` -> ``fused_projections.FusedMLP``: the
  gated-delta layer's four input projections, attention's q, k and v (``GroupedAttention`` projects through the fused
  one), the MoE block's router, shared expert gate and shared expert's gate and up (``FusedSparseMoeBlock``), and an
  MLP's gate and up, as one matmul each; the MoE switch's gate and up experts as one gather (fused_projections.py; the
  parts' arrays become views of the fused ones, in the VLM's own language model too). CPU and CUDA; Metal keeps
  separate projections until measured there.
- ``DecoderLayer`` (gated-delta) -> ``compiled_decode.CompiledDecoderLayer``: the one-token step as one compiled graph.
  CPU and CUDA, where it was measured (``compiled_decode_devices``); Metal keeps mlx-lm's until measured there.
- mlx-lm's ``SwitchGLU`` -> ``moe_dispatch.DispatchedSwitchGLU``: the MoE switch sorts a call's pairs or not by the call's
  size as measured on the loaded model (``moe_dispatch.measure``, which ``build_text_model`` runs). Every device.
``apply`` makes them on a built text model and its MTP head; a SpecPrefill draft gets the recurrence only.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from ..backbone import FusedGatedDeltaNet
from ..mlx_lm_internals import MLP, Attention, GatedDeltaNet, SparseMoeBlock
from .compiled_decode import use_compiled_decode
from .cpu_experts import use_float32_experts
from .device import kind, on_cuda
from .fused_projections import (
    ATTENTION_QKV,
    GATE_UP,
    GATED_DELTA_INPUTS,
    MOE_INPUTS,
    FusedMLP,
    FusedSparseMoeBlock,
    Fusion,
    use_fused_projections,
)
from .grouped_attention import GroupedAttention
from .moe_dispatch import DispatchedSwitchGLU, use_dispatched_switch
from .retype import modules_of, retype
from .skinny_matmul import SkinnyLinear


@dataclass(frozen=True)
class Swapped:
    """How many modules took each class."""

    fused_recurrence: int
    grouped_attention: int
    skinny_matmul: int
    float32_experts: int = 0
    compiled_decode: int = 0
    moe_switches: int = 0
    fused_projections: int = 0  # arrays now views of a fused projection's


# Projections of one input run as one: the gated-delta layers' inputs (their call is the engine's gated_delta_layer),
# attention's q, k and v, the MoE block's router, shared expert gate and shared expert's gate and up, the other MLPs'
# gate and up, the MoE switch's gate and up experts (one gather). The text model's layers only: an MTP head may be a
# host drafter's, whose arrays the drafter holds.
FUSIONS = (
    Fusion(GatedDeltaNet, GATED_DELTA_INPUTS, FusedGatedDeltaNet, lambda m: m.sharding_group is None),
    Fusion(FusedGatedDeltaNet, GATED_DELTA_INPUTS, FusedGatedDeltaNet),
    Fusion(GroupedAttention, ATTENTION_QKV, GroupedAttention),
    Fusion(SparseMoeBlock, MOE_INPUTS, FusedSparseMoeBlock, lambda m: m.sharding_group is None),
    Fusion(MLP, GATE_UP, FusedMLP),
    Fusion(DispatchedSwitchGLU, GATE_UP, DispatchedSwitchGLU),
)
# Where projections of one input run as one matmul: where it was measured (CPU: bitwise the same, fewer ops; CUDA:
# fewer launches of a launch-bound step).
fused_projection_devices = {"cpu", "cuda"}


# Where the gated-delta layers' one-token step runs compiled: where it was measured to take less CPU per step.
compiled_decode_devices = {"cpu", "cuda"}


def use_fused_recurrence(model: nn.Module) -> int:
    """On MLX's CUDA backend, give the model's gated-delta layers the fused recurrence; the
    arithmetic is mlx-lm's, position by position, so outputs match it to rounding. Returns how
    many layers changed (0 off CUDA)."""
    if not on_cuda():
        return 0
    return retype((getattr(layer, "linear_attn", None) for layer in model.model.layers), GatedDeltaNet,
                  FusedGatedDeltaNet, lambda lin: lin.sharding_group is None)


def use_skinny_matmul(module: nn.Module) -> int:
    """On MLX's CUDA backend, give every plain ``nn.Linear`` under ``module`` the few-row kernel
    (quantized layers keep theirs). Returns how many changed (0 off CUDA)."""
    if not on_cuda():
        return 0
    return retype(modules_of(module), nn.Linear, SkinnyLinear)


def use_grouped_attention(model: nn.Module) -> int:
    """Give every mlx-lm attention layer under ``model`` the grouped call; how many changed."""
    return retype(modules_of(model), Attention, GroupedAttention)


def apply(model: nn.Module, head: nn.Module | None, shares: nn.Module | None = None) -> Swapped:
    """Every swap the text model (an mlx-lm qwen3_5 ``TextModel``) and its MTP head take on this device; ``shares``: a
    module holding the text model's own arrays (the VLM's language model), given the fused projections' views too."""
    fused = use_fused_recurrence(model)
    grouped = use_grouped_attention(model) + (use_grouped_attention(head) if head is not None else 0)
    skinny = use_skinny_matmul(model.model) + (use_skinny_matmul(head) if head is not None else 0)
    experts = use_float32_experts(model) + (use_float32_experts(head) if head is not None else 0)
    compiled = use_compiled_decode(model) if kind() in compiled_decode_devices else 0
    switches = use_dispatched_switch(model) + (use_dispatched_switch(head) if head is not None else 0)
    # last: a fused module is a copy of its first part, which by now has the class this device gives it
    fused_arrays = use_fused_projections(model, FUSIONS, shares) if kind() in fused_projection_devices else 0
    return Swapped(fused_recurrence=fused, grouped_attention=grouped, skinny_matmul=skinny, float32_experts=experts,
                   compiled_decode=compiled, moe_switches=switches, fused_projections=fused_arrays)
