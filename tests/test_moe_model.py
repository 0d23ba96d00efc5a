"""The tiny Qwen3.5-MoE VLM at the engine level: its expert layouts, the admission projection against measured peaks,
and bf16 experts on MLX's CPU backend (whose GatherMM is float32-only).

The model is the trained tiny model made MoE (support/moe_model.py, conftest `moe_vlm_factory`): 4 experts, 2 per
token, a shared expert, in every layer and in the MTP head.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx_mtp_routing.admission import MemoryModel

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def _load(path: Path):
    from mlx_vlm import load

    return load(str(path))


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_expert_layouts_load_the_same_model(moe_vlm_factory: Callable[..., Path]) -> None:
    """Fused and per-expert raw HF checkpoints load (mlx-vlm's backbone, the plugin's MTP head) into exactly the
    tensors of the MLX layout."""
    from vllm_mlx_mtp_routing.model.text_model import load_mtp_weights

    mlx_path = moe_vlm_factory("mlx")
    config = _config(mlx_path)
    assert config["model_type"] == "qwen3_5_moe" and "intermediate_size" not in config["text_config"]
    ref, processor = _load(mlx_path)
    ids = mx.array([processor.tokenizer.encode(PROMPT)])
    ref_logits = ref.language_model(ids).logits
    ref_head = load_mtp_weights(mlx_path)
    assert ref_head is not None and "layers.0.mlp.switch_mlp.gate_proj.weight" in ref_head.weights
    keys = {"fused": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
            "per-expert": ("mlp.experts.3.gate_proj.weight", "mlp.experts.0.down_proj.weight")}
    for layout, expected in keys.items():
        path = moe_vlm_factory(layout)
        names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        for suffix in expected:  # the backbone's layers and the head's, in the layout's own names
            assert f"model.language_model.layers.0.{suffix}" in names and f"mtp.layers.0.{suffix}" in names
        model, _ = _load(path)
        assert mx.array_equal(model.language_model(ids).logits, ref_logits), layout
        head = load_mtp_weights(path)
        assert head is not None and head.norms_shifted and set(head.weights) == set(ref_head.weights)
        assert all(mx.array_equal(head.weights[k], v) for k, v in ref_head.weights.items()), layout


def test_moe_config_is_read_for_its_experts() -> None:
    """A Qwen3.5-35B-A3B-shaped config: the experts size the MLP term, not a dense intermediate size (which MoE
    configs lack, and mlx-lm's args default to 14336)."""
    text = {
        "model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "full_attention_interval": 4, "hidden_size": 2048,
        "vocab_size": 248320, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1, "dtype": "bfloat16",
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    }  # fmt: skip
    mm = MemoryModel.from_model_config({"model_type": "qwen3_5_moe", "text_config": text})
    assert (mm.num_experts, mm.num_experts_per_tok, mm.moe_intermediate_size, mm.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert mm.intermediate_size == 0
    as_args = MemoryModel.from_model_config({**text, "intermediate_size": 14336})  # what TextModelArgs' fields give
    assert as_args.project_parts(4000, 500) == mm.project_parts(4000, 500)
    # per token: 8 experts' inputs, up/gate/activation and down outputs, the shared expert, the router over 256
    d, h = 2, 2048
    assert mm._mlp_bytes_per_token == d * (8 * (2 * 512 + 3 * h) + 2 * 512 + 3 * h + 2 * 256) + 4 * (256 + 24)


def _engine_peak(model, tokenizer, mtp, prompt_tokens: int, max_tokens: int, step: int) -> tuple[int, MemoryModel]:
    from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
    from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
    from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
    from vllm_mlx_mtp_routing.text_engine.state import TextRequest

    sched = BatchScheduler(model, tokenizer, prefill_step_size=step, decode=MTPDecode(mtp, k=1))
    rng = np.random.default_rng(0)
    for rid, n in (("warm-up", 40), ("measured", prompt_tokens)):  # the first request's one-time set-up is not its
        if rid == "measured":
            gc.collect()
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
        sched.add(TextRequest(rid, rng.integers(10, 3000, size=n).tolist(), SamplingOptions(max_tokens=max_tokens)))
        while sched.has_work():
            sched.step()
    return mx.get_peak_memory() - base, sched.memory_model()


@pytest.mark.slow
def test_projection_is_within_1_25x_of_the_text_engines_peak(moe_vlm_factory: Callable[..., Path]) -> None:
    """A text request on the MoE model through the text engine (prefill in chunks, MTP decode): the projection the
    admission controller reserves is at least the peak it adds (mx.get_peak_memory) and at most 1.25x of it."""
    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    path = moe_vlm_factory("mlx")
    vlm, processor = _load(path)
    bundle = build_text_model(vlm, path, _config(path))
    assert bundle.mtp is not None
    for prompt_tokens, step in ((300, 512), (1300, 512)):
        peak, mm = _engine_peak(bundle.model, processor.tokenizer, bundle.mtp, prompt_tokens, 16, step)
        assert mm.num_experts == 4 and mm.intermediate_size == 0
        projected = mm.project(prompt_tokens, 16)
        assert peak <= projected <= 1.25 * peak, (prompt_tokens, peak, projected)


@pytest.mark.slow
def test_projection_bounds_mlx_vlms_prefill(moe_vlm_factory: Callable[..., Path]) -> None:
    """The media path's projection (the config's, mlx-vlm's own layers and caches): a bound on a real prefill's
    peak, within 1.35x of it."""
    path = moe_vlm_factory("mlx")
    vlm, _ = _load(path)
    lm = vlm.language_model
    step = 512
    mm = MemoryModel.from_model_config(_config(path), prefill_step_size=step, include_mtp=False, draft_tokens=0)
    for prompt_tokens in (300, 1300):
        tokens = mx.random.randint(0, 1000, (1, prompt_tokens))
        mx.eval(tokens)
        gc.collect()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        cache = lm.make_cache()
        for s in range(0, prompt_tokens, step):
            out = lm(tokens[:, s : s + step], cache=cache)
            mx.eval([c.state for c in cache], out.logits[:, -1])
            del out
        peak = mx.get_peak_memory() - base
        del cache
        projected = mm.project(prompt_tokens, 0)
        assert peak <= projected <= 1.35 * peak, (prompt_tokens, peak, projected)


def test_bf16_experts_run_in_float32_on_the_cpu(moe_vlm_factory: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    """MLX's CPU GatherMM takes float32 only: a bf16 MoE fails its first forward unless its experts multiply in float32,
    which building the text model arranges (one warning), for the VLM's own layers too."""
    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    if mx.default_device() != mx.cpu:
        pytest.skip("MLX's CPU backend only")
    path = moe_vlm_factory("mlx", "bfloat16")
    vlm, processor = _load(path)
    ids = mx.array([processor.tokenizer.encode(PROMPT)])
    with pytest.raises(RuntimeError, match="GatherMM"):  # what the host meets on every request
        mx.eval(vlm.language_model(ids).logits)
    with caplog.at_level(logging.WARNING, logger="vllm_mlx_mtp_routing"):
        bundle = build_text_model(vlm, path, _config(path))
    warnings = [r.getMessage() for r in caplog.records if "GatherMM" in r.getMessage()]
    assert len(warnings) == 1 and "27 MoE expert projections (and the VLM's 24) hold bfloat16" in warnings[0]
    fp32, _ = _load(moe_vlm_factory("mlx", "float32"))
    reference = fp32.language_model(ids).logits
    # the text path (mlx-lm's layers) and the host's (mlx-vlm's): bf16 weights and activations against float32
    for logits in (bundle.model(ids), vlm.language_model(ids).logits):
        logits = logits.astype(mx.float32)
        assert (logits.argmax(-1) == reference.argmax(-1)).mean().item() >= 0.9
        assert mx.abs(logits - reference).max().item() < 0.1 * mx.abs(reference).max().item()
