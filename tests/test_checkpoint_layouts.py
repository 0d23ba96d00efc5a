"""The MTP head from every checkpoint layout users have, bf16 or quantized, at the engine level.

Every (layout x precision) cell is built the way users get it: the tiny model exported as a raw HF
checkpoint, converted by mlx-vlm's own `convert` (bf16, 8-bit g64, 4-bit g32, mixed_4_8) with its
`--mtp` drafter split, the head then placed per layout (checkpoint_variants). Each cell loads through
`build_text_model` (the code the server runs); the truth for the head is mlx-vlm's own drafter loader
(`load_drafter`) on the same files. Through the real server, tests/test_checkpoint_layouts_e2e.py
serves every layout x {bf16, 8-bit, 4-bit} of the trained model.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from support.checkpoint_variants import PRECISIONS, variant
from support.reference_decode import greedy_generate, mtp_greedy_generate
from vllm_mlx_mtp_routing.model.checkpoint_layouts import NO_MTP_HINT, MTPUnavailable, quantize_like, read_drafter_folder
from vllm_mlx_mtp_routing.model.text_model import build_text_model

HEAD_LAYOUTS = ("subdir", "model-mtp", "mtp-file", "main", "drafter")
PROMPT = [11, 200, 37, 400, 5, 981, 42, 7, 300]
# quantization the conversion gives each precision: (bits, group size) of the head's linears
BF16_LOGIT_RTOL = 0.1
HEAD_QUANT = {"bf16": None, "8bit": (8, 64), "4bit": (4, 32), "mixed": (4, 64)}


@pytest.fixture(scope="session")
def variants_root(tmp_path_factory, tiny_vlm_factory) -> tuple[Path, Path]:
    return tmp_path_factory.mktemp("variants"), tiny_vlm_factory("float32", "subdir")


def _cell(variants_root, layout: str, precision: str):
    from mlx_vlm import load
    from mlx_vlm.speculative.drafters import load_drafter

    root, source = variants_root
    v = variant(root, source, layout, precision)
    vlm = load(str(v.model))[0]
    config = json.loads((v.model / "config.json").read_text())
    # mlx-vlm's drafter from the same conversion: the truth for the head's tensors
    truth_path = v.drafter or root / f"converted-{precision}" / "drafter"
    if layout == "main" and precision == "bf16":
        truth_path = v.model  # the raw HF checkpoint: mlx-vlm splits its mtp.* in memory (+1 on norms)
    truth = load_drafter(str(truth_path), kind="mtp")[0]
    return v, vlm, config, truth


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_head_loads_equal_to_mlx_vlm_drafter_and_decodes_exactly(variants_root, layout, precision):
    v, vlm, config, truth = _cell(variants_root, layout, precision)
    drafter = truth if layout == "drafter" else None  # the host's loaded drafter, as the server passes it
    bundle = build_text_model(vlm, v.model, config, drafter=drafter, drafter_path=v.drafter)
    assert bundle.mtp is not None, bundle.mtp_unavailable_reason
    expected_source = {"subdir": "mtp/weights.safetensors", "model-mtp": "model-mtp.safetensors",
                       "mtp-file": "mtp.safetensors", "drafter": "--mllm-draft-model"}.get(layout, "safetensors")
    assert expected_source in bundle.mtp_source

    ours = dict(tree_flatten(bundle.mtp.parameters()))
    theirs = dict(tree_flatten(truth.parameters()))
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert mx.array_equal(ours[name], value), name  # same values: norms in the same convention
        if layout == "drafter":
            assert ours[name] is value  # shared with the host's drafter, not copied
    quant = {(m.bits, m.group_size) for _, m in bundle.mtp.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert quant == ({HEAD_QUANT[precision]} if HEAD_QUANT[precision] else set())

    # The text model's logits are the VLM's (raw HF too: its +1 norms come from mlx-vlm, once). mlx-lm's and
    # mlx-vlm's gated-delta kernels round differently in bf16 (a few % here); a norm off by one is ~100%.
    ids = mx.array([PROMPT])
    ours, theirs = bundle.model(ids).astype(mx.float32), vlm.language_model(ids).logits.astype(mx.float32)
    assert mx.abs(ours - theirs).max().item() < BF16_LOGIT_RTOL * mx.abs(theirs).max().item()

    plain = greedy_generate(bundle.model, PROMPT, 8)
    mtp = mtp_greedy_generate(bundle.model, bundle.mtp, PROMPT, 8, k=2)
    assert mtp.tokens == plain.tokens and mtp.drafted > 0


def test_head_logits_equal_mlx_vlm_drafter_forward(variants_root):
    """Our head's forward equals mlx-vlm's qwen3_5_mtp drafter on the same inputs (8-bit conversion)."""
    v, vlm, config, truth = _cell(variants_root, "drafter", "8bit")
    bundle = build_text_model(vlm, v.model, config, drafter_path=v.drafter)  # read from the folder
    assert not any(a is b for a, b in zip(tree_flatten(bundle.mtp.parameters()), tree_flatten(truth.parameters())))
    tokens = mx.array([PROMPT[1:]])
    _, hidden = __import__("vllm_mlx_mtp_routing.model.mtp", fromlist=["forward_with_hidden"]).forward_with_hidden(
        bundle.model, mx.array([PROMPT[:-1]])
    )
    ours = bundle.mtp(hidden, tokens)
    truth.bind(vlm)
    embed = vlm.language_model.model.embed_tokens(tokens)
    positions = mx.arange(tokens.shape[1])[None]
    theirs = vlm.language_model.lm_head(truth._forward_hidden(embed, hidden, None, positions))
    assert mx.allclose(ours, theirs, atol=2e-2, rtol=0).item()
    assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(theirs, -1))


def test_mixed_precision_head_gets_each_module_its_own_bits(variants_root, tmp_path):
    """A head quantized per module by mlx-lm's quantize_model (8-bit g32 down/v projections, 4-bit g64 elsewhere,
    as mixed recipes do), in the layout mlx-vlm's split writes: a qwen3_5_mtp drafter folder."""
    from mlx_lm.utils import quantize_model
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.mtp import MTPHead

    root, source_model = variants_root
    v = variant(root, source_model, "drafter", "bf16")
    weights, _, _ = read_drafter_folder(v.drafter)
    config = json.loads((v.model / "config.json").read_text())
    vlm = load(str(v.model))[0]
    text = build_text_model(vlm, v.model, config, enable_mtp=False).model
    source = MTPHead(text.args, 1).bind(text)
    source.load_weights(list(weights.items()))
    eight = {"group_size": 32, "bits": 8}
    _, qconfig = quantize_model(source, {}, 64, 4, quant_predicate=lambda p, m: eight if ("down_proj" in p or "v_proj" in p) else True)
    mixed = dict(tree_flatten(source.parameters()))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    mx.save_safetensors(str(drafter / "model.safetensors"), mixed, metadata={"format": "mlx"})
    folder_config = json.loads((v.drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**folder_config, "quantization": qconfig["quantization"]}))

    loaded = build_text_model(vlm, v.model, config, drafter_path=drafter)
    got = {p: (m.bits, m.group_size) for p, m in loaded.mtp.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert got["layers.0.mlp.down_proj"] == got["layers.0.self_attn.v_proj"] == (8, 32)
    assert got["layers.0.mlp.up_proj"] == got["fc"] == (4, 64)
    ours = dict(tree_flatten(loaded.mtp.parameters()))
    assert all(mx.array_equal(ours[k], a) for k, a in mixed.items())
    plain = greedy_generate(loaded.model, PROMPT, 16)
    assert mtp_greedy_generate(loaded.model, loaded.mtp, PROMPT, 16, k=2).tokens == plain.tokens


def test_quantize_like_tells_biasless_modes_and_rejects_unknown():
    head = nn.Sequential(nn.Linear(64, 32, bias=False))
    w, s = mx.quantize(mx.random.normal((32, 64)), group_size=32, bits=4, mode="mxfp4")
    quantize_like(head, {"layers.0.weight": w, "layers.0.scales": s})
    assert head.layers[0].mode == "mxfp4" and head.layers[0].bits == 4
    odd = nn.Sequential(nn.Linear(64, 32, bias=False))
    w, s, _ = mx.quantize(mx.random.normal((32, 64)), group_size=64, bits=4)
    with pytest.raises(ValueError, match="without biases"):
        quantize_like(odd, {"layers.0.weight": w, "layers.0.scales": s})


@pytest.mark.parametrize("precision", ["bf16", "4bit"])
def test_no_mtp_checkpoint_says_why_and_how(variants_root, precision):
    v, vlm, config, _ = _cell(variants_root, "none", precision)
    bundle = build_text_model(vlm, v.model, config)
    assert bundle.mtp is None and bundle.mtp_unavailable_reason == "no MTP weights in the checkpoint"
    status = MTPUnavailable(bundle.mtp_unavailable_reason).stats()
    assert status == {"enabled": False, "reason": "no MTP weights in the checkpoint", "how_to_enable": NO_MTP_HINT}
    assert "--mtp" in NO_MTP_HINT and "--mllm-draft-model" in NO_MTP_HINT


def test_drafter_folder_that_is_not_one_is_a_clear_reason(variants_root):
    v, vlm, config, _ = _cell(variants_root, "none", "bf16")
    bundle = build_text_model(vlm, v.model, config, drafter_path=v.model)  # a VLM, not a qwen3_5_mtp folder
    assert bundle.mtp is None and "not an mlx-vlm qwen3_5_mtp drafter folder" in bundle.mtp_unavailable_reason


def test_mllm_draft_requests_stay_on_a_text_path_that_drafts():
    from vllm_mlx_mtp_routing.routing import text_path_gap

    assert text_path_gap({"mllm_draft": True}) == "a host drafter was requested and the text path has no MTP head"
    assert text_path_gap({"mllm_draft": True}, text_mtp=True) is None
    assert text_path_gap({"mllm_draft": False}) is None
    assert text_path_gap({"specprefill": True}, text_mtp=True) is None  # SpecPrefill runs on the text path


def test_host_mtp_drafter_reads_the_host_engine():
    from types import SimpleNamespace

    from vllm_mlx_mtp_routing.host.engine_access import host_mtp_drafter

    drafter = object()
    engine = SimpleNamespace(_mllm_draft_model="/m-mtp", _mllm_draft_kind="mtp",
                             _mllm_instance=SimpleNamespace(_draft_model=drafter))
    assert host_mtp_drafter(engine) == ("/m-mtp", drafter)
    assert host_mtp_drafter(SimpleNamespace(_mllm_draft_model="/m-mtp", _mllm_draft_kind="mtp")) == ("/m-mtp", None)
    assert host_mtp_drafter(SimpleNamespace(_mllm_draft_model="/d", _mllm_draft_kind=None)) == (None, None)
    assert host_mtp_drafter(object()) == (None, None)


def test_checkpoint_variants_cli(variants_root, capsys):
    from support import checkpoint_variants

    root, source = variants_root
    assert checkpoint_variants.main([str(source), str(root), "--layout", "drafter", "--precision", "8bit"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["serve_flags"] == ["--mllm-draft-model", out["drafter"], "--mllm-draft-kind", "mtp"]
    assert json.loads((Path(out["drafter"]) / "config.json").read_text())["model_type"] == "qwen3_5_mtp"
    with pytest.raises(SystemExit):
        checkpoint_variants.main([str(source), str(root), "--precision", "3bit"])
