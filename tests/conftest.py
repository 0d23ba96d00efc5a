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
