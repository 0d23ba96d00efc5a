"""Shared pytest fixtures: tiny random Qwen3.5 VLM checkpoints, built once per session."""

from __future__ import annotations

import os

# Set before any test module imports transformers/mlx_vlm: nothing may reach the hub.
os.environ["HF_HUB_OFFLINE"] = "1"

from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_mlx_mtp_routing.testing.tiny_model import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_vlm_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(dtype="float32", placement="subdir") -> Path`, each pair built once per session."""
    root = tmp_path_factory.mktemp("tiny_vlm")

    def factory(dtype: str = "float32", placement: str = "subdir") -> Path:
        return tiny_model_dir(root, dtype=dtype, placement=placement)

    return factory


@pytest.fixture(scope="session")
def tiny_vlm_fp32(tiny_vlm_factory: Callable[..., Path]) -> Path:
    """fp32 tiny Qwen3.5 VLM, MTP head in mtp/weights.safetensors: use it for exactness checks."""
    return tiny_vlm_factory("float32", "subdir")


@pytest.fixture(scope="session")
def tiny_vlm_bf16(tiny_vlm_factory: Callable[..., Path]) -> Path:
    """bf16 tiny Qwen3.5 VLM (the fp32 weights rounded), MTP head in mtp/weights.safetensors."""
    return tiny_vlm_factory("bfloat16", "subdir")


@pytest.fixture(scope="module")
def tiny_text(tiny_vlm_fp32: Path):
    """(the host's mlx-lm TextModel built from the fp32 tiny VLM, without MTP; its tokenizer), per test module."""
    from mlx_vlm import load
    from vllm_mlx.text_model_from_vlm import build_text_model

    vlm, processor = load(str(tiny_vlm_fp32))
    model = build_text_model(vlm, tiny_vlm_fp32, enable_mtp=False)
    assert model is not None
    return model, processor.tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_vlm_fp32: Path):
    """(the plugin's TextBundle from the fp32 tiny VLM, MTP head loaded; its tokenizer), per test module."""
    import json

    from mlx_vlm import load

    from vllm_mlx_mtp_routing.text_model import build_text_model

    vlm, processor = load(str(tiny_vlm_fp32))
    bundle = build_text_model(vlm, tiny_vlm_fp32, json.loads((tiny_vlm_fp32 / "config.json").read_text()))
    assert bundle.mtp is not None
    return bundle, processor.tokenizer


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_vlm_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SpecPrefill draft for the tiny model: 2 layers (one full-attention), its tokenizer, other weights."""
    from vllm_mlx_mtp_routing.testing.tiny_model import build_tiny_qwen35_vlm

    out = tmp_path_factory.mktemp("draft") / "tiny-draft"
    build_tiny_qwen35_vlm(out, num_layers=2, full_attention_interval=2, mtp_placement="none", tokenizer_from=tiny_vlm_fp32, seed=5)
    return out
