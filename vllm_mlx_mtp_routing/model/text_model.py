"""An mlx-lm qwen3_5 TextModel over a loaded mlx-vlm Qwen3.5 VLM's language backbone, zero-copy,
plus the checkpoint's MTP head.

Zero-copy: the TextModel's parameters are the very `mx.array` objects of the VLM's
`language_model` (checked by identity, `assert_zero_copy`); the only new memory is the MTP head.

With the host's `--mllm-draft-model PATH --mllm-draft-kind mtp`, the head is that drafter (its
loaded arrays shared, else the mlx-vlm qwen3_5_mtp folder read; see checkpoint_layouts). Otherwise
MTP weights are looked for, in order, in
  1. mtp/weights.safetensors        (keys `mtp.*`, or bare keys)
  2. model-mtp.safetensors          (keys `mtp.*`, or bare keys)
     mtp.safetensors                (the same; what mlx-lm's proposed --preserve-mtp writes)
  3. the main shards                (keys `mtp.*`, `language_model.mtp.*`, `model.language_model.mtp.*`,
                                     `model.mtp.*`; through model.safetensors.index.json, else
                                     model.safetensors)
and only the MTP tensors are read (mx.load is lazy: only the picked arrays are materialised).
Quantized heads take each module's group size and bits from its tensors (mixed precision included).

RMSNorm convention. Qwen3.5's HF checkpoints store zero-centred norm weights (gamma - 1: the
module computes x * (1 + w)); MLX stores gamma. The rule, one decision per MTP source:
  a. a manifest.json beside the file declaring `rmsnorm_weight_format` decides: `mlx_gamma` keeps
     the weights, `hf_offset` / `zero_centered` / `offset` adds 1;
  b. else a non-MLX writer in the safetensors metadata (`format` pt/tf/flax/np: a raw HF
     checkpoint) or HF key naming (`model.language_model.*`) means zero-centred: add 1;
  c. else (written by MLX tools, or no metadata: conversions and legacy sidecars) the values
     decide: the mean of all the head's RMSNorm weights below 0.5 means zero-centred (add 1),
     otherwise MLX gamma. Trained gammas sit near 1 and their offsets near 0.
mlx-lm's own sanitize is never run on these weights: it adds 1 to every norm as soon as it sees
an `mtp.` key, whatever the convention.
"""

from __future__ import annotations

import gc
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .checkpoint_layouts import (
    DRAFTER_MODEL_TYPE,
    drafter_weights,
    is_drafter_folder,
    is_norm_key,
    quantize_like,
    read_config,
    read_drafter_folder,
)
from .kernels import gated_delta_layer, moe_dispatch, swaps
from .kernels.cpu_experts import use_float32_experts
from .kernels.device import kind as device_kind
from .mlx_lm_internals import TextModel, TextModelArgs
from .mtp import MTPHead, resolve_hidden_state_mode

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3_5",)  # prefixes: qwen3_5, qwen3_5_text, qwen3_5_moe, ...
# Files that hold only the head: vllm-mlx's tooling (first two), mlx-lm's proposed --preserve-mtp (last).
MTP_FILES = ("mtp/weights.safetensors", "model-mtp.safetensors", "mtp.safetensors")
MTP_KEY_PREFIXES = ("model.language_model.mtp.", "language_model.mtp.", "model.mtp.", "mtp.")
_GAMMA_FORMATS = {"mlx_gamma", "gamma", "mlx"}
_OFFSET_FORMATS = {"hf_offset", "zero_centered", "zero_centred", "offset", "hf"}
_NON_MLX_WRITERS = {"pt", "tf", "flax", "np", "numpy", "paddle"}


class TextModelUnavailable(Exception):
    """The text path cannot be built for this model; the caller logs `reason` once and routes
    every request to the media path."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class TextModelBundle:
    model: TextModel
    mtp: MTPHead | None
    shared_arrays: int
    mtp_bytes: int
    extra_bytes: int
    mtp_source: str | None = None
    mtp_norms_shifted: bool = False
    mtp_unavailable_reason: str | None = None
    hidden_state_mode: str = "post_norm"


# --------------------------------------------------------------------------------------------
# Backbone
# --------------------------------------------------------------------------------------------


def _language_model(vlm_model: Any) -> Any:
    lm = getattr(vlm_model, "language_model", None)
    if lm is None or not hasattr(lm, "parameters"):
        raise TextModelUnavailable(f"{type(vlm_model).__name__} has no language_model")
    return lm


def assert_zero_copy(vlm_model: Any, text_model: TextModel) -> int:
    """Every TextModel parameter is the same mx.array object as the VLM's; returns how many.

    vlm_model may be the VLM or its language_model."""
    lm = vlm_model if hasattr(vlm_model, "model") and not hasattr(vlm_model, "language_model") else None
    source = dict(tree_flatten((lm or _language_model(vlm_model)).parameters()))
    ours = cast("list[tuple[str, mx.array]]", tree_flatten(text_model.parameters()))
    bad = [name for name, arr in ours if source.get(name) is not arr]
    if bad:
        raise TextModelUnavailable(f"TextModel is not zero-copy: {len(bad)} arrays differ, e.g. {bad[:3]}")
    return len(ours)


def _quantization_params(module: nn.Module) -> dict | None:
    if not hasattr(module, "scales"):
        return None
    params = {"group_size": module.group_size, "bits": module.bits}
    if getattr(module, "mode", "affine") != "affine":
        params["mode"] = module.mode
    return params


def _build_backbone(lm: Any, text_config: dict) -> tuple[TextModel, int]:
    source = dict(tree_flatten(lm.parameters()))
    # The loaded VLM is the truth about tying: mlx-vlm creates lm_head only when untied.
    text_config = {**text_config, "tie_word_embeddings": "lm_head.weight" not in source}
    try:
        model = TextModel(TextModelArgs.from_dict(text_config))
    except Exception as e:  # a config the skeleton cannot take
        raise TextModelUnavailable(f"cannot build mlx-lm qwen3_5 TextModel: {e}") from e

    vlm_modules = dict(lm.named_modules())
    if any(_quantization_params(m) for m in vlm_modules.values()):
        # Quantize exactly the modules the VLM has quantized, with their own group size/bits.
        nn.quantize(
            model,
            class_predicate=lambda path, m: hasattr(m, "to_quantized")
            and path in vlm_modules
            and (_quantization_params(vlm_modules[path]) or False),
        )

    ours = dict(tree_flatten(model.parameters()))
    missing = sorted(ours.keys() - source.keys())
    if missing:
        raise TextModelUnavailable(
            f"VLM language model lacks {len(missing)} TextModel parameters, e.g. {missing[:3]}"
        )
    wrong = [k for k, v in ours.items() if v.shape != source[k].shape]
    if wrong:
        raise TextModelUnavailable(f"shape mismatch for {len(wrong)} parameters, e.g. {wrong[:3]}")
    # update() stores the given arrays themselves: no copy. The skeleton's random init is lazy
    # and never evaluated, so it never allocates.
    model.update(tree_unflatten([(k, source[k]) for k in ours]))
    # mlx-lm's GatedDeltaNet picks its fused kernel only when not training.
    model.train(False)
    # Realise non-parameter arrays (RoPE tables) on this thread: a lazy graph is bound to the
    # stream of the thread that recorded it.
    mx.eval([v for m in model.modules() for v in m.values() if isinstance(v, mx.array)])
    return model, assert_zero_copy(lm, model)


def _expert_dtype(model: nn.Module) -> str:
    dtypes = {str(m["weight"].dtype).removeprefix("mlx.core.") for _, m in model.named_modules()
              if type(m).__name__.endswith("SwitchLinear") and "weight" in m}
    return "/".join(sorted(dtypes))


# --------------------------------------------------------------------------------------------
# MTP weights
# --------------------------------------------------------------------------------------------


@dataclass
class MTPWeights:
    weights: dict[str, mx.array]  # MTP-relative keys ("fc.weight", "layers.0....")
    source: str  # for logs: where they came from
    norms_shifted: bool
    norm_rule: str


def _strip_mtp_prefix(key: str) -> str | None:
    for prefix in MTP_KEY_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def _read_manifest(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_dedicated(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    tensors, metadata = cast("tuple[dict[str, mx.array], dict[str, str]]", mx.load(str(path), return_metadata=True))
    picked = {k: v for key, v in tensors.items() if (k := _strip_mtp_prefix(key)) is not None}
    return (picked or tensors), metadata


def _read_main_shards(model_path: Path) -> tuple[dict[str, mx.array], list[dict[str, str]], list[str], bool]:
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        hf_naming = any(k.startswith("model.language_model.") for k in weight_map)
        shards: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            if _strip_mtp_prefix(key) is not None:
                shards.setdefault(shard, []).append(key)
    elif (model_path / "model.safetensors").exists():
        shards, hf_naming = {"model.safetensors": []}, False
    else:
        return {}, [], [], False

    picked: dict[str, mx.array] = {}
    metadata: list[dict[str, str]] = []
    for shard, keys in shards.items():
        if not (model_path / shard).exists():
            raise FileNotFoundError(f"MTP shard {shard} listed in the index is missing")
        # Lazy: only the arrays picked here are ever read from the file.
        tensors, meta = cast("tuple[dict[str, mx.array], dict[str, str]]", mx.load(str(model_path / shard), return_metadata=True))
        metadata.append(meta)
        for key in keys or list(tensors):
            if (k := _strip_mtp_prefix(key)) is not None and key in tensors:
                picked[k] = tensors[key]
                hf_naming = hf_naming or key.startswith("model.language_model.")
        del tensors
    return picked, metadata, sorted(shards), hf_naming


def _decide_norm_shift(
    weights: dict[str, mx.array], manifest: dict, metadata: list[dict[str, str]], hf_naming: bool
) -> tuple[bool, str]:
    declared = str(manifest.get("rmsnorm_weight_format", "")).lower()
    if declared in _GAMMA_FORMATS:
        return False, f"manifest declares {declared}"
    if declared in _OFFSET_FORMATS:
        return True, f"manifest declares {declared}"
    writers = {str(m.get("format", "")).lower() for m in metadata} & _NON_MLX_WRITERS
    if writers or hf_naming:
        why = f"format {','.join(sorted(writers))}" if writers else "HF key names"
        return True, f"raw HF checkpoint ({why})"
    norms = [v for k, v in weights.items() if is_norm_key(k, v)]
    if not norms:
        return False, "no RMSNorm weights"
    mean = cast(float, mx.mean(mx.concatenate([n.astype(mx.float32) for n in norms])).item())
    return mean < 0.5, f"MLX-written, RMSNorm mean {mean:.3f}"


def _merge_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Fused (`experts.gate_up_proj`) or per-expert MoE tensors -> mlx-lm's switch_mlp layout."""
    out = dict(weights)
    for key in [k for k in out if k.endswith(".experts.gate_up_proj")]:
        base = key[: -len(".experts.gate_up_proj")]
        gate, up = mx.split(out.pop(key), 2, axis=-2)
        out[f"{base}.switch_mlp.gate_proj.weight"] = gate
        out[f"{base}.switch_mlp.up_proj.weight"] = up
        if (down := out.pop(f"{base}.experts.down_proj", None)) is not None:
            out[f"{base}.switch_mlp.down_proj.weight"] = down
    pattern = re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    for key in out:
        if m := pattern.fullmatch(key):
            groups.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = key
    for (base, proj, kind), experts in groups.items():
        out[f"{base}.switch_mlp.{proj}.{kind}"] = mx.stack([out.pop(experts[e]) for e in sorted(experts)])
    return out


def load_mtp_weights(model_path: Path) -> MTPWeights | None:
    """The checkpoint's MTP tensors in MLX gamma convention, or None when it has none."""
    model_path = Path(model_path)
    manifest: dict = {}
    hf_naming = False
    for rel in MTP_FILES:
        path = model_path / rel
        if path.exists():
            weights, meta = _read_dedicated(path)
            metadata, source = [meta], rel
            manifest = _read_manifest(path.with_name("manifest.json"))
            break
    else:
        weights, metadata, shards, hf_naming = _read_main_shards(model_path)
        source = ",".join(shards)
        manifest = _read_manifest(model_path / "mtp" / "manifest.json")
    if not weights:
        return None
    shift, rule = _decide_norm_shift(weights, manifest, metadata, hf_naming)
    if shift:
        weights = {k: (v + 1.0 if is_norm_key(k, v) else v) for k, v in weights.items()}
    return MTPWeights(_merge_experts(weights), source, shift, rule)


def _mtp_layers(text_config: dict, config: dict) -> int:
    return int(text_config.get("mtp_num_hidden_layers") or text_config.get("num_nextn_predict_layers")
               or config.get("num_nextn_predict_layers") or 0)


def _host_drafter_weights(drafter: Any, drafter_path: Path | None) -> tuple[MTPWeights, dict, int]:
    """The host's `--mllm-draft-model` head: its loaded mlx-vlm drafter's own arrays when given,
    else the folder read from disk. Returns (weights, quantization config, layers)."""
    folder = read_config(drafter_path) if drafter_path is not None else {}
    drafter_text = folder.get("text_config") or {}
    if drafter is not None:
        weights = drafter_weights(drafter)
        where = f"the host's --mllm-draft-model ({drafter_path or type(drafter).__name__}, shared)"
        loaded = MTPWeights(_merge_experts(weights), where, False, "mlx-vlm drafter (MLX gamma)")
        config_obj = getattr(drafter, "config", None)
        layers = len(getattr(drafter, "layers", ()))
    else:
        if drafter_path is None or not is_drafter_folder(drafter_path):
            raise ValueError(f"{drafter_path} is not an mlx-vlm {DRAFTER_MODEL_TYPE} drafter folder")
        weights, shifted, rule = read_drafter_folder(drafter_path)
        loaded = MTPWeights(_merge_experts(weights), f"--mllm-draft-model {drafter_path}", shifted, rule)
        config_obj = None
        layers = _mtp_layers(drafter_text, folder)
    quantization = folder.get("quantization") or getattr(config_obj, "quantization", None) or {}
    return loaded, quantization, layers


def _build_mtp_head(
    text_model: TextModel,
    text_config: dict,
    config: dict,
    model_path: Path,
    drafter: Any = None,
    drafter_path: Path | None = None,
) -> tuple[MTPHead | None, MTPWeights | None, str | None]:
    if text_config.get("mtp_use_dedicated_embeddings"):
        return None, None, "dedicated MTP embeddings are not supported"
    loaded: MTPWeights | None
    try:
        if drafter is not None or drafter_path is not None:
            loaded, quantization, layers = _host_drafter_weights(drafter, drafter_path)
        else:
            layers = _mtp_layers(text_config, config)
            if layers <= 0:
                return None, None, "config declares no MTP layers"
            loaded, quantization = load_mtp_weights(model_path), config.get("quantization") or {}
    except (OSError, ValueError) as e:
        return None, None, f"cannot read MTP weights: {e}"
    if loaded is None:
        return None, None, "no MTP weights in the checkpoint"
    if layers <= 0:
        return None, loaded, f"MTP weights from {loaded.source} have no decoder layer"
    head = MTPHead(text_model.args, layers, resolve_hidden_state_mode(config)).bind(text_model)
    try:
        quantize_like(head, loaded.weights, quantization)
        # load_weights stores the given arrays: a host drafter's head is shared, not copied.
        head.load_weights(list(loaded.weights.items()), strict=True)
    except ValueError as e:
        return None, loaded, f"MTP weights from {loaded.source} do not fit the head: {e}"
    head.train(False)
    mx.eval(head.parameters())
    mx.eval([v for m in head.modules() for v in m.values() if isinstance(v, mx.array)])
    return head, loaded, None


# --------------------------------------------------------------------------------------------


def build_text_model(
    vlm_model: Any,
    model_path: Path,
    config: dict,
    *,
    enable_mtp: bool = True,
    drafter: Any = None,
    drafter_path: Path | None = None,
) -> TextModelBundle:
    """Zero-copy TextModel over the VLM's language backbone, plus the MTP head if the checkpoint
    has one. Raises TextModelUnavailable when the text path cannot be served by it.

    `drafter` / `drafter_path`: the host's `--mllm-draft-model` (its loaded mlx-vlm drafter and
    folder); when given, the head comes from there rather than from the checkpoint.

    extra_bytes is the growth of mx.get_active_memory() across the build (process-wide: other
    threads allocating meanwhile would show up in it).
    """
    model_path = Path(model_path)
    text_config = config.get("text_config", config)
    model_type = str(text_config.get("model_type") or config.get("model_type") or "")
    if not model_type.startswith(SUPPORTED_MODEL_TYPES):
        raise TextModelUnavailable(f"model_type {model_type!r} is not a Qwen3.5 hybrid model")
    try:
        hidden_state_mode = resolve_hidden_state_mode(config)
    except ValueError as e:
        raise TextModelUnavailable(str(e)) from e
    lm = _language_model(vlm_model)

    gc.collect()  # so collectable garbage freed mid-build does not hide in the measured growth
    before = mx.get_active_memory()
    model, shared = _build_backbone(lm, text_config)
    head: MTPHead | None
    loaded: MTPWeights | None
    reason: str | None
    head, loaded, reason = (None, None, "MTP not enabled")
    if enable_mtp:
        head, loaded, reason = _build_mtp_head(model, text_config, config, model_path, drafter, drafter_path)
    swapped = swaps.apply(model, head, shares=lm)
    if swapped.moe_switches:
        moe_dispatch.measure(model, head)
    if swapped.fused_recurrence:
        one = device_kind() in gated_delta_layer.fused_layer_devices
        logger.info("TextModel: %d gated-delta layers run %s", swapped.fused_recurrence,
                    "their conv, gates, head norms and recurrence as one CUDA kernel a decode step" if one
                    else "the fused CUDA recurrence (one launch per call)")
    if swapped.float32_experts:
        # The VLM's own layers too: the host's path (media requests) runs them.
        vlm_experts = use_float32_experts(lm)
        logger.warning(
            "TextModel: %d MoE expert projections (and the VLM's %d) hold %s weights, and MLX's CPU backend multiplies "
            "experts (GatherMM) in float32 only: they run in float32 per call (slower); a float32 or quantized "
            "conversion avoids it (`python -m mlx_vlm.convert --hf-path ... --dtype float32`, or `-q`)",
            swapped.float32_experts, vlm_experts, _expert_dtype(model),
        )
    if swapped.skinny_matmul:
        logger.info("TextModel: %d linear layers run the few-row CUDA matmul at 2-8 rows", swapped.skinny_matmul)
    extra = mx.get_active_memory() - before
    mtp_bytes = sum(v.nbytes for _, v in cast("list[tuple[str, mx.array]]", tree_flatten(head.parameters()))) if head else 0

    name = model_path.name or str(model_path)
    # one line per build: what the fused projections made is part of it (their arrays are views, no new memory)
    fused = f"; projections of one input fused ({swapped.fused_projections} arrays are views)" if swapped.fused_projections else ""
    if head is not None:
        assert loaded is not None  # a head is built from loaded weights
        logger.info(
            "TextModel built zero-copy from %s: shared %d arrays, MTP head +%.1f MiB "
            "(%d layer(s) from %s, RMSNorm %s: %s)%s",
            name, shared, extra / 2**20, len(head.layers), loaded.source,
            "+1 applied" if loaded.norms_shifted else "kept", loaded.norm_rule, fused,
        )
    else:
        logger.info(
            "TextModel built zero-copy from %s: shared %d arrays, no MTP head (%s), +%.1f MiB%s",
            name, shared, reason, extra / 2**20, fused,
        )
    return TextModelBundle(
        model=model,
        mtp=head,
        shared_arrays=shared,
        mtp_bytes=mtp_bytes,
        extra_bytes=extra,
        mtp_source=loaded.source if loaded else None,
        mtp_norms_shifted=bool(loaded and loaded.norms_shifted),
        mtp_unavailable_reason=None if head is not None else reason,
        hidden_state_mode=hidden_state_mode,
    )
