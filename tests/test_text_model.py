"""Zero-copy TextModel from the VLM backbone and MTP weight loading for every checkpoint layout."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from vllm_mlx_mtp_routing.model.text_model import (
    TextModelUnavailable,
    assert_zero_copy,
    build_text_model,
    load_mtp_weights,
)

MTP_PLACEMENTS = ("subdir", "model-mtp", "main")
# The mlx-lm and mlx-vlm GatedDeltaNet implementations differ in rounding (~1e-5 per layer in
# fp32), so the text model's logits match the VLM's to this tolerance, not bit for bit.
LOGIT_ATOL = 1e-3
# Growth of active memory beyond the MTP head's own bytes, either way: RoPE tables and allocator rounding (fused
# projections hold their parts' small arrays in one buffer, which can round to less).
MEMORY_SLACK = 64 * 1024


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _load(path: Path):
    from mlx_vlm import load

    return load(str(path))[0]


def _file_mtp_tensors(path: Path, placement: str) -> dict[str, mx.array]:
    """The MTP tensors as stored on disk, read independently of the code under test."""
    file, prefix = {
        "subdir": ("mtp/weights.safetensors", "mtp."),
        "model-mtp": ("model-mtp.safetensors", "mtp."),
        "main": ("model.safetensors", "language_model.mtp."),
    }[placement]
    return {k[len(prefix) :]: v for k, v in mx.load(str(path / file)).items() if k.startswith(prefix)}


@pytest.fixture(scope="module", params=MTP_PLACEMENTS + ("none",))
def built(request, tiny_vlm_factory):
    path = tiny_vlm_factory("float32", request.param)
    vlm = _load(path)
    return request.param, path, vlm, build_text_model(vlm, path, _config(path))


def test_every_backbone_array_is_shared_by_identity(built):
    _, _, vlm, bundle = built
    source = dict(tree_flatten(vlm.language_model.parameters()))
    ours = tree_flatten(bundle.model.parameters())
    assert len(ours) == len(source) == bundle.shared_arrays == 56
    assert all(arr is source[name] for name, arr in ours)
    assert assert_zero_copy(vlm, bundle.model) == 56
    assert not bundle.model.training


def test_mtp_weights_equal_file_values(built):
    placement, path, _, bundle = built
    if placement == "none":
        assert bundle.mtp is None and "no MTP weights" in bundle.mtp_unavailable_reason
        return
    stored = _file_mtp_tensors(path, placement)
    loaded = dict(tree_flatten(bundle.mtp.parameters()))
    assert loaded.keys() == stored.keys()
    for name, value in stored.items():
        assert mx.array_equal(loaded[name], value), name  # no +1 shift on the norms
    assert not bundle.mtp_norms_shifted
    assert mx.mean(loaded["norm.weight"]).item() == pytest.approx(1.0, abs=0.1)


def test_text_logits_match_vlm_language_model(built):
    _, _, vlm, bundle = built
    ids = mx.array([[11, 200, 37, 4000, 5, 981, 42, 7, 300]])
    ours, theirs = bundle.model(ids), vlm.language_model(ids).logits
    assert mx.allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0).item()
    assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(theirs, -1))


def test_memory_growth_is_the_mtp_head(built):
    placement, path, _, bundle = built
    if placement == "none":
        assert bundle.mtp_bytes == 0 and abs(bundle.extra_bytes) <= MEMORY_SLACK
        return
    stored = sum(v.nbytes for v in _file_mtp_tensors(path, placement).values())
    assert bundle.mtp_bytes == stored
    assert abs(bundle.extra_bytes - bundle.mtp_bytes) <= MEMORY_SLACK, (bundle.extra_bytes, bundle.mtp_bytes)


def test_one_info_line_and_no_warning(tiny_vlm_factory, caplog):
    path = tiny_vlm_factory("float32", "main")  # the host warns "No MTP weights found" here
    vlm = _load(path)
    with caplog.at_level(logging.DEBUG):
        bundle = build_text_model(vlm, path, _config(path))
    assert bundle.mtp is not None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    ours = [r.getMessage() for r in caplog.records if r.name == "vllm_mlx_mtp_routing.model.text_model"]
    assert len(ours) == 1
    assert ours[0].startswith(f"TextModel built zero-copy from {path.name}: shared 56 arrays, MTP head +")
    assert "projections of one input fused (" in ours[0]  # the CPU fuses them (swaps.fused_projection_devices)


def test_mtp_can_be_disabled(tiny_vlm_factory):
    path = tiny_vlm_factory("float32", "subdir")
    bundle = build_text_model(_load(path), path, _config(path), enable_mtp=False)
    assert bundle.mtp is None and bundle.mtp_bytes == 0


def test_unsupported_or_incomplete_models_raise(tiny_vlm_factory):
    path = tiny_vlm_factory("float32", "subdir")
    vlm, config = _load(path), _config(path)
    qwen2 = {**config, "model_type": "qwen2_vl", "text_config": {**config["text_config"], "model_type": "qwen2_vl"}}
    with pytest.raises(TextModelUnavailable, match="qwen2_vl"):
        build_text_model(vlm, path, qwen2)
    with pytest.raises(TextModelUnavailable, match="language_model"):
        build_text_model(object(), path, config)
    wider = {**config, "text_config": {**config["text_config"], "intermediate_size": 256}}
    with pytest.raises(TextModelUnavailable, match="shape mismatch"):
        build_text_model(vlm, path, wider)
    deeper = {**config, "text_config": {**config["text_config"], "num_hidden_layers": 8,
                                        "layer_types": config["text_config"]["layer_types"] * 2}}
    with pytest.raises(TextModelUnavailable, match="lacks"):
        build_text_model(vlm, path, deeper)
    bad_mode = {**config, "text_config": {**config["text_config"], "mtp_hidden_state_mode": "mid"}}
    with pytest.raises(TextModelUnavailable, match="mtp_hidden_state_mode"):
        build_text_model(vlm, path, bad_mode)


# --- the RMSNorm convention rule on layouts the tiny builder does not write -----------------


def _zero_centred(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    from vllm_mlx_mtp_routing.model.checkpoint_layouts import is_norm_key

    return {k: (v - 1.0 if is_norm_key(k, v) else v) for k, v in tensors.items()}


@pytest.mark.parametrize(
    "layout",
    ["raw_hf_main_shard", "legacy_sidecar_zero_centred", "legacy_sidecar_gamma", "manifest_says_offset"],
)
def test_norm_convention_rule(tiny_vlm_factory, tmp_path, layout):
    gamma = _file_mtp_tensors(tiny_vlm_factory("float32", "subdir"), "subdir")
    if layout == "raw_hf_main_shard":
        # Qwen/Qwen3.5-* on the hub: top-level mtp.* in a PyTorch-written shard, HF key names.
        shard = {f"mtp.{k}": v for k, v in _zero_centred(gamma).items()}
        shard["model.language_model.norm.weight"] = mx.zeros((64,))
        mx.save_safetensors(str(tmp_path / "model-00001-of-00001.safetensors"), shard, metadata={"format": "pt"})
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {k: "model-00001-of-00001.safetensors" for k in shard}})
        )
        expect_shift = True
    else:
        (tmp_path / "mtp").mkdir()
        values = gamma if layout == "legacy_sidecar_gamma" else _zero_centred(gamma)
        # vllm-mlx's add_mtp_weights_qwen35.py writes no metadata and no manifest.
        mx.save_safetensors(str(tmp_path / "mtp" / "weights.safetensors"), {f"mtp.{k}": v for k, v in values.items()})
        if layout == "manifest_says_offset":
            (tmp_path / "mtp" / "manifest.json").write_text(json.dumps({"rmsnorm_weight_format": "hf_offset"}))
        expect_shift = layout != "legacy_sidecar_gamma"

    loaded = load_mtp_weights(tmp_path)
    assert loaded is not None and loaded.norms_shifted is expect_shift
    assert loaded.weights.keys() == gamma.keys()
    for k, v in gamma.items():
        assert mx.allclose(loaded.weights[k], v, atol=1e-6).item(), k


def test_manifest_gamma_wins_over_values(tiny_vlm_factory, tmp_path):
    src = tiny_vlm_factory("float32", "subdir")
    shutil.copytree(src / "mtp", tmp_path / "mtp")
    loaded = load_mtp_weights(tmp_path)
    assert not loaded.norms_shifted and "manifest" in loaded.norm_rule


def test_quantized_backbone_and_mtp_stay_zero_copy(tiny_vlm_factory, tmp_path):
    import mlx.nn as nn

    src = tiny_vlm_factory("float32", "subdir")
    vlm = _load(src)
    nn.quantize(vlm.language_model, group_size=32, bits=4)
    # A quantized sidecar (as vllm-mlx's add_mtp_weights_qwen35.py writes by default).
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "mtp").mkdir()
    gamma = _file_mtp_tensors(src, "subdir")
    quantized = {}
    for k, v in gamma.items():
        if v.ndim == 2 and not k.startswith("fc."):
            w, s, b = mx.quantize(v, group_size=32, bits=4)
            base = k[: -len(".weight")]
            quantized.update({f"mtp.{k}": w, f"mtp.{base}.scales": s, f"mtp.{base}.biases": b})
        else:
            quantized[f"mtp.{k}"] = v
    mx.save_safetensors(str(tmp_path / "mtp" / "weights.safetensors"), quantized)

    bundle = build_text_model(vlm, tmp_path, _config(tmp_path))
    assert bundle.shared_arrays == assert_zero_copy(vlm, bundle.model) > 56
    ids = mx.array([[11, 200, 37, 4000, 5]])
    assert mx.allclose(bundle.model(ids), vlm.language_model(ids).logits, atol=LOGIT_ATOL, rtol=0).item()
    q_proj = bundle.mtp.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and (q_proj.group_size, q_proj.bits) == (32, 4)
    assert mx.array_equal(q_proj.weight, quantized["mtp.layers.0.self_attn.q_proj.weight"])
    assert not bundle.mtp_norms_shifted
