"""The host's SpecPrefill flags read for the text path, and its draft model (vllm-mlx 0.6.0).

``--specprefill``, ``--specprefill-threshold``, ``--specprefill-keep-pct``,
``--specprefill-backbone-pct`` and ``--specprefill-draft-model`` keep the host's meaning. At flag
validation (before anything loads) a bad value, a missing draft, a draft without a full-attention
layer or a draft whose tokenizer differs from the target's exits 2 naming the flag. The draft
itself is the one the host's BatchedEngine already loaded for media SpecPrefill
(``_specprefill_draft_model``, loaded with ``mlx_lm.load`` in ``prepare_for_start``), or loaded
here the same way when the host's load did not happen or failed.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from ..plugin_api.errors import FlagError
from ..specprefill.settings import SpecPrefillSettings

logger = logging.getLogger("vllm_mlx_mtp_routing.specprefill")

DRAFT_FLAG = "--specprefill-draft-model"


def _local_dir(name: str | None) -> Path | None:
    """A model argument as a local directory (a path, or a repository already in the hub cache)."""
    if not name:
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        return None


def _vocab(path: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(str(path)).get_vocab())


def _has_full_attention(config: dict) -> bool:
    text = config.get("text_config") or config
    types = text.get("layer_types")
    if types is not None:
        return "full_attention" in types
    interval = text.get("full_attention_interval")
    layers = text.get("num_hidden_layers")
    return not (interval and layers and int(layers) < int(interval))


def check_tokenizers(draft_dir: Path, target_dir: Path) -> None:
    """FlagError naming the draft flag unless both tokenizers map the same strings to the same ids."""
    try:
        draft, target = _vocab(draft_dir), _vocab(target_dir)
    except Exception as exc:
        raise FlagError(DRAFT_FLAG, f"cannot read the tokenizer of {draft_dir} or of the model to compare them: {exc}") from exc
    if draft != target:
        differ = sum(1 for k, v in draft.items() if target.get(k) != v) + sum(1 for k in target if k not in draft)
        raise FlagError(
            DRAFT_FLAG,
            f"{draft_dir} has a different tokenizer from the model ({len(draft)} vs {len(target)} tokens, {differ} differ); "
            "SpecPrefill's draft must share the target's tokenizer",
        )


def from_args(args: Any) -> tuple[SpecPrefillSettings, str] | None:
    """(settings, draft path) with --specprefill, else None; FlagError naming a bad flag. Where the
    text path cannot run (no --continuous-batching, --mtp-routing-disable) the flags are the host's alone."""
    if args is None or not getattr(args, "specprefill", False):
        return None
    if not getattr(args, "continuous_batching", False) or getattr(args, "mtp_routing_disable", False):
        return None
    threshold = getattr(args, "specprefill_threshold", 8192)
    keep = getattr(args, "specprefill_keep_pct", 0.3)
    backbone = getattr(args, "specprefill_backbone_pct", 0.0) or 0.0
    if not isinstance(threshold, int) or threshold < 0:
        raise FlagError("--specprefill-threshold", f"must be an integer >= 0, got {threshold!r}")
    if not (isinstance(keep, (int, float)) and math.isfinite(keep) and 0.0 < keep <= 1.0):
        raise FlagError("--specprefill-keep-pct", f"must be in (0, 1], got {keep!r}")
    if not (isinstance(backbone, (int, float)) and math.isfinite(backbone) and 0.0 <= backbone <= keep):
        raise FlagError("--specprefill-backbone-pct", f"must be in [0, --specprefill-keep-pct={keep}], got {backbone!r}")
    draft = getattr(args, "specprefill_draft_model", None)
    if not draft:
        raise FlagError(DRAFT_FLAG, "--specprefill needs a draft model (a small model with the same tokenizer)")
    draft_dir = _local_dir(draft)
    if draft_dir is None:
        raise FlagError(DRAFT_FLAG, f"{draft} is not a local model directory or a model in the local hub cache")
    config_path = draft_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except Exception as exc:
        raise FlagError(DRAFT_FLAG, f"cannot read {config_path}: {exc}") from exc
    if not _has_full_attention(config):
        raise FlagError(DRAFT_FLAG, f"{draft} has no full-attention layer, whose queries SpecPrefill scores the prompt with")
    target_dir = _local_dir(getattr(args, "model", None))
    if target_dir is not None:
        check_tokenizers(draft_dir, target_dir)
    else:
        logger.warning("SpecPrefill: cannot find %s locally before loading; its tokenizer is compared with the draft's after load",
                       getattr(args, "model", None))
    settings = SpecPrefillSettings(threshold=threshold, keep_pct=float(keep), backbone_pct=float(backbone))
    return settings, str(draft_dir)


def check_loaded_tokenizer(draft_path: str, tokenizer: Any) -> None:
    """After load, where the target was not local at validation: RuntimeError on a mismatch."""
    target = dict(tokenizer.get_vocab())
    if _vocab(Path(draft_path)) != target:
        raise RuntimeError(f"{DRAFT_FLAG} {draft_path}: its tokenizer differs from the model's")


def load_draft(engine: Any, draft_path: str) -> Any:
    """The host's loaded draft when it has one, else ``mlx_lm.load(draft_path)``'s model."""
    draft = getattr(engine, "_specprefill_draft_model", None)
    if draft is not None:
        return draft
    from mlx_lm import load

    model = load(draft_path)[0]
    return model
