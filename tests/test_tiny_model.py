"""The tiny Qwen3.5 VLM builder, checked against the real mlx-vlm, mlx-lm and vllm-mlx loaders."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from jinja2.exceptions import TemplateError

from support import tiny_model
from support.tiny_model import build_tiny_qwen35_vlm
from support.tokenizer_builder import SPECIAL_TOKENS, tokenizer_info

SYSTEM_LATE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "system", "content": "Now answer in French."},
    {"role": "user", "content": "How are you?"},
]


@pytest.fixture(scope="module")
def vlm_fp32(tiny_vlm_fp32):
    from mlx_vlm import load

    return load(str(tiny_vlm_fp32))


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_layout_is_hybrid_with_vision_and_mtp(tiny_vlm_fp32):
    cfg = _config(tiny_vlm_fp32)
    t = cfg["text_config"]
    assert t["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert t["mtp_num_hidden_layers"] == 1
    weights = mx.load(str(tiny_vlm_fp32 / "model.safetensors"))
    assert any(k.startswith("vision_tower.blocks.") for k in weights)
    assert "language_model.model.layers.0.linear_attn.A_log" in weights
    assert "language_model.model.layers.3.self_attn.q_proj.weight" in weights
    assert not any("mtp." in k for k in weights)
    mtp = mx.load(str(tiny_vlm_fp32 / "mtp" / "weights.safetensors"))
    assert mtp and all(k.startswith("mtp.") for k in mtp)
    index = json.loads((tiny_vlm_fp32 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights)


@pytest.mark.parametrize(
    "placement, main_has_mtp, mtp_file",
    [
        ("subdir", False, "mtp/weights.safetensors"),
        ("model-mtp", False, "model-mtp.safetensors"),
        ("main", True, None),
        ("none", False, None),
    ],
)
def test_mtp_placements(tiny_vlm_factory, placement, main_has_mtp, mtp_file):
    path = tiny_vlm_factory("float32", placement)
    main = mx.load(str(path / "model.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    main_mtp = [k for k in main if k.startswith("language_model.mtp.")]
    assert bool(main_mtp) == main_has_mtp
    assert set(index) == set(main)
    assert (path / "mtp").exists() == (placement == "subdir")
    assert (path / "model-mtp.safetensors").exists() == (placement == "model-mtp")
    if mtp_file:
        assert all(k.startswith("mtp.") for k in mx.load(str(path / mtp_file)))


@pytest.mark.parametrize(
    "placement, mtp_injected, mlx_lm_norms_shifted",
    [("subdir", True, False), ("model-mtp", True, True), ("main", False, True), ("none", False, False)],
)
def test_placements_reproduce_the_hosts_loader_behaviour(
    tiny_vlm_factory, placement, mtp_injected, mlx_lm_norms_shifted
):
    """What each placement does to the real loaders (documented in tiny_model's docstring)."""
    import mlx_lm
    from mlx_vlm import load
    from vllm_mlx.text_model_from_vlm import build_text_model

    path = tiny_vlm_factory("float32", placement)
    vlm, _ = load(str(path))
    text_model = build_text_model(vlm, path, enable_mtp=True)
    assert (getattr(text_model, "mtp", None) is not None) == mtp_injected
    # mlx_lm's qwen3_5 sanitize reads any "mtp." key as a raw HF checkpoint and adds 1 to
    # every RMSNorm weight: logits far off from the VLM's.
    tokens = mx.array([[5, 6, 7, 8, 900]])
    lm_model, _ = mlx_lm.load(str(path))
    gap = mx.abs(lm_model(tokens) - vlm.language_model(tokens).logits).max().item()
    assert (gap > 1.0) == mlx_lm_norms_shifted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_vlm_loads_and_generates(tiny_vlm_factory, dtype):
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template

    path = tiny_vlm_factory(dtype)
    model, processor = load(str(path))
    assert model.language_model.model.embed_tokens.weight.dtype == getattr(mx, dtype)
    prompt = apply_chat_template(processor, model.config, "Write a function.", num_images=0)
    result = generate(model, processor, prompt, max_tokens=12, verbose=False)
    assert result.generation_tokens == 12
    tok = tokenizer_info(path)
    # Special and padding ids have zeroed lm_head rows, so greedy decoding never picks them.
    assert all(i < tok["tokenizer_size"] and i not in tok["special_token_ids"] for i in result.token_ids)


def test_build_text_model_shares_backbone_and_loads_mtp(tiny_vlm_fp32, vlm_fp32):
    from vllm_mlx.text_model_from_vlm import build_text_model

    model, _ = vlm_fp32
    text_model = build_text_model(model, tiny_vlm_fp32, enable_mtp=True)
    assert text_model is not None
    assert text_model.model.embed_tokens.weight is model.language_model.model.embed_tokens.weight
    assert text_model.mtp is not None and hasattr(text_model, "mtp_forward")
    on_disk = mx.load(str(tiny_vlm_fp32 / "mtp" / "weights.safetensors"))
    assert mx.array_equal(text_model.mtp.fc.weight, on_disk["mtp.fc.weight"])
    # MLX-gamma norms, declared by the manifest, so no +1 shift was applied.
    assert mx.array_equal(text_model.mtp.norm.weight, on_disk["mtp.norm.weight"])

    tokens = mx.array([[11, 257, 1024, 7, 3000, 42]])
    text_logits = text_model(tokens)
    vlm_logits = model.language_model(tokens).logits
    assert text_logits.shape == (1, 6, 4096)
    # Different kernels (M-RoPE vs RoPE paths) give float32 rounding differences only.
    assert mx.abs(text_logits - vlm_logits).max().item() < 1e-2
    assert mx.array_equal(text_logits.argmax(-1), vlm_logits.argmax(-1))


def test_build_text_model_bf16(tiny_vlm_bf16):
    from mlx_vlm import load
    from vllm_mlx.text_model_from_vlm import build_text_model

    model, _ = load(str(tiny_vlm_bf16))
    text_model = build_text_model(model, tiny_vlm_bf16, enable_mtp=True)
    assert text_model is not None and text_model.mtp is not None
    logits = text_model(mx.array([[1, 2, 3]]))
    assert logits.dtype == mx.bfloat16 and logits.shape == (1, 3, 4096)


def test_processor_renders_and_expands_an_image(vlm_fp32):
    from PIL import Image

    model, processor = vlm_fp32
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    inputs = processor(text=[text], images=[Image.new("RGB", (64, 64), (200, 30, 30))], return_tensors="np")
    ids = inputs["input_ids"][0].tolist()
    # 64x64 pixels = 4x4 patches of 16, merged 2x2 into 4 image tokens.
    assert ids.count(model.config.image_token_id) == 4
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_vision_tower_changes_the_logits(vlm_fp32):
    from PIL import Image

    model, processor = vlm_fp32
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def last_logits(color):
        inputs = processor(text=[text], images=[Image.new("RGB", (64, 64), color)], return_tensors="np")
        out = model(
            mx.array(inputs["input_ids"]),
            pixel_values=mx.array(inputs["pixel_values"]),
            mask=mx.array(inputs["attention_mask"]),
            image_grid_thw=mx.array(inputs["image_grid_thw"]),
        )
        return out.logits[0, -1]

    assert mx.abs(last_logits((0, 0, 0)) - last_logits((255, 255, 255))).max().item() > 1e-3


def test_chat_template_rejects_a_late_system_message(vlm_fp32):
    tokenizer = vlm_fp32[1].tokenizer
    with pytest.raises(TemplateError, match="System message must be at the beginning."):
        tokenizer.apply_chat_template(SYSTEM_LATE, tokenize=False)
    ok = tokenizer.apply_chat_template(SYSTEM_LATE[:3] + SYSTEM_LATE[4:], tokenize=False, add_generation_prompt=True)
    assert ok.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_chat_template_tools_and_thinking(vlm_fp32):
    tokenizer = vlm_fp32[1].tokenizer
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22C"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>" in text
    results = "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in text
    no_think = tokenizer.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tokenizer_ids_and_zeroed_logit_rows(tiny_vlm_fp32, vlm_fp32):
    tok = tokenizer_info(tiny_vlm_fp32)
    ids = tok["special_ids"]
    eot = ids["<|endoftext|>"]
    # Qwen3.5's relative layout of the added tokens.
    assert (ids["<|im_start|>"], ids["<|im_end|>"], ids["<|vision_start|>"], ids["<|image_pad|>"]) == (
        eot + 1, eot + 2, eot + 9, eot + 12,
    )  # fmt: skip
    tokenizer = vlm_fp32[1].tokenizer
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.encode("<|im_start|>user")[0] == ids["<|im_start|>"]
    assert tokenizer.decode(tokenizer.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    lm_head = np.array(mx.load(str(tiny_vlm_fp32 / "model.safetensors"))["language_model.lm_head.weight"])
    zero_rows = set(np.flatnonzero(~lm_head.any(axis=1)).tolist())
    assert zero_rows == {ids[t] for t in SPECIAL_TOKENS} | set(range(tok["tokenizer_size"], 4096))


def test_bf16_is_fp32_rounded_and_shares_the_tokenizer(tiny_vlm_fp32, tiny_vlm_bf16):
    a = mx.load(str(tiny_vlm_fp32 / "model.safetensors"))
    b = mx.load(str(tiny_vlm_bf16 / "model.safetensors"))
    assert set(a) == set(b)
    for k in ("language_model.lm_head.weight", "vision_tower.patch_embed.proj.weight"):
        assert b[k].dtype == mx.bfloat16 and mx.array_equal(a[k].astype(mx.bfloat16), b[k])
    assert b["language_model.model.layers.0.linear_attn.A_log"].dtype == mx.float32
    assert (tiny_vlm_fp32 / "tokenizer.json").read_bytes() == (tiny_vlm_bf16 / "tokenizer.json").read_bytes()


def test_rebuild_in_place_with_own_tokenizer_and_force(tmp_path, tiny_vlm_fp32):
    out = tmp_path / "m"
    first = build_tiny_qwen35_vlm(out, tokenizer_from=tiny_vlm_fp32, seed=1)
    with pytest.raises(FileExistsError):
        build_tiny_qwen35_vlm(out, tokenizer_from=tiny_vlm_fp32)
    second = build_tiny_qwen35_vlm(out, tokenizer_from=out, seed=2, force=True, mtp_placement="none")
    assert first["special_ids"] == second["special_ids"]
    assert second["mtp_placement"] == "none" and second["params_mtp"] == 0
    assert not (out / "mtp").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging directory left behind


def test_rejects_bad_arguments(tmp_path, tiny_vlm_fp32):
    with pytest.raises(ValueError, match="mtp_placement"):
        build_tiny_qwen35_vlm(tmp_path / "a", tokenizer_from=tiny_vlm_fp32, mtp_placement="elsewhere")
    with pytest.raises(ValueError, match="dtype"):
        build_tiny_qwen35_vlm(tmp_path / "b", tokenizer_from=tiny_vlm_fp32, dtype="int8")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_qwen35_vlm(tmp_path / "c", tokenizer_from=tiny_vlm_fp32, vocab_size=1000)
    assert not any(tmp_path.iterdir())


def test_cli(tmp_path, tiny_vlm_fp32, capsys):
    out = tmp_path / "cli"
    argv = [str(out), "--dtype", "bf16", "--mtp-placement", "model-mtp", "--tokenizer-from", str(tiny_vlm_fp32)]
    assert tiny_model.main(argv) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtype"] == "bfloat16" and info["mtp_placement"] == "model-mtp"
    assert (out / "model-mtp.safetensors").exists()
    assert tiny_model.main(argv) == 2  # exists, no --force
    assert tiny_model.main(argv + ["--force"]) == 0


def test_trains_its_own_tokenizer(tmp_path):
    info = build_tiny_qwen35_vlm(tmp_path / "fresh", dtype="bfloat16", num_layers=2, full_attention_interval=2)
    assert info["tokenizer_size"] == 4000 + len(tokenizer_info(tmp_path / "fresh")["special_ids"])
    assert _config(tmp_path / "fresh")["text_config"]["layer_types"] == ["linear_attention", "full_attention"]
