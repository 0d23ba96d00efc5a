"""MTP heads that live outside the checkpoint's own files, and how to quantize a head like its source.

Besides the layouts `text_model.load_mtp_weights` reads (mtp/weights.safetensors,
model-mtp.safetensors, `mtp.*` in the main shards), users have:
  - mlx-vlm 0.7.10's drafter folder (`model_type: qwen3_5_mtp`, written by `mlx_vlm.convert --mtp`
    or its `speculative/drafters/qwen3_5_mtp/split.py`): bare head keys, MLX gamma norms, and in
    config.json the `quantization` the splitter applied. The host takes it through
    `--mllm-draft-model PATH --mllm-draft-kind mtp`.
  - that drafter already loaded by the host (`Qwen3_5MTPDraftModel`): the text path shares its
    arrays (the same drafter, no second copy).
A checkpoint with none of these is served without MTP; `NO_MTP_HINT` says how to get one that has it.
`is_norm_key` picks the head's RMSNorm weights, whose convention (MLX gamma or zero-centred) every reader
decides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

DRAFTER_MODEL_TYPE = "qwen3_5_mtp"
NO_MTP_HINT = (
    "convert the original Hugging Face checkpoint with mlx-vlm, which keeps the head as a drafter: "
    "`python -m mlx_vlm.convert --hf-path Qwen/Qwen3.5-... --mlx-path OUT --mtp [-q --q-bits 4]`, then serve "
    "OUT with `--mllm-draft-model OUT-mtp --mllm-draft-kind mtp`; or use a conversion that keeps "
    "mtp/weights.safetensors, model-mtp.safetensors or mtp.* tensors (mlx-lm's convert drops them)"
)
# The head's RMSNorm weights (their convention, MLX gamma or zero-centred, is decided per source).
MTP_NORM_SUFFIXES = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "pre_fc_norm_hidden.weight",
    "pre_fc_norm_embedding.weight",
)
# Quantization modes without biases, told apart by (bits, group size) as mlx's defaults set them.
_BIASLESS_MODES = {(4, 32): "mxfp4", (4, 16): "nvfp4", (8, 32): "mxfp8"}


def is_norm_key(key: str, value: mx.array) -> bool:
    """Whether a head-relative tensor is one of the head's RMSNorm weights."""
    return value.ndim == 1 and (key == "norm.weight" or key.endswith(MTP_NORM_SUFFIXES))


def read_config(path: Path) -> dict:
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_drafter_folder(path: Path) -> bool:
    return read_config(path).get("model_type") == DRAFTER_MODEL_TYPE


def read_drafter_folder(path: Path) -> tuple[dict[str, mx.array], bool, str]:
    """The head's tensors from an mlx-vlm qwen3_5_mtp drafter folder: (weights, norms_shifted, rule).

    Mirrors mlx-vlm's drafter sanitize: bare keys are MLX gamma; `mtp.`-prefixed keys (an HF
    layout dropped into the folder) are zero-centred and get +1 on their norms."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors in MTP drafter folder {path}")
    raw: dict[str, mx.array] = {}
    for f in files:
        raw.update(cast("dict[str, mx.array]", mx.load(str(f))))
    hf = [k for k in raw if k.startswith("mtp.")]
    if not hf:
        return raw, False, "mlx-vlm drafter folder (MLX gamma)"
    out = {}
    for key, value in raw.items():
        shift = key.startswith("mtp.")
        key = key.removeprefix("mtp.")
        out[key] = value + 1.0 if shift and is_norm_key(key, value) else value
    return out, True, "mlx-vlm drafter folder with HF mtp.* keys"


def drafter_weights(drafter: nn.Module) -> dict[str, mx.array]:
    """A loaded mlx-vlm drafter's parameters by head-relative name: the arrays themselves, not copies."""
    return dict(tree_flatten(drafter.parameters()))


def _module_quantization(path: str, weights: dict[str, mx.array], in_dims: int, config: dict) -> dict | None:
    scales = weights.get(f"{path}.scales")
    if scales is None:
        return None
    packed = weights[f"{path}.weight"]
    params: dict[str, Any] = {"group_size": in_dims // scales.shape[-1], "bits": packed.shape[-1] * 32 // in_dims}
    declared = config.get(path) if isinstance(config.get(path), dict) else config
    mode = declared.get("mode") if isinstance(declared, dict) else None
    if mode is None and f"{path}.biases" not in weights:
        mode = _BIASLESS_MODES.get((params["bits"], params["group_size"]))
        if mode is None:
            raise ValueError(f"{path}: quantized without biases at {params['bits']} bits, group {params['group_size']}")
    if mode and mode != "affine":
        params["mode"] = mode
    return params


def quantize_like(head: nn.Module, weights: dict[str, mx.array], config: dict | None = None) -> None:
    """Quantize each of the head's modules that arrives quantized, with its own group size and bits
    (from the tensors' shapes: mixed precision needs no config) and mode (from `config`'s
    `quantization`, else told by the missing biases)."""
    if not any(k.endswith(".scales") for k in weights):
        return
    config = dict(config or {})

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):
            return False
        return _module_quantization(path, weights, module.weight.shape[-1], config) or False

    nn.quantize(head, class_predicate=predicate)


class MTPUnavailable:
    """The text path's MTP status when MTP was asked for but the checkpoint has no usable head."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def stats(self) -> dict[str, Any]:
        return {"enabled": False, "reason": self.reason, "how_to_enable": NO_MTP_HINT}
