"""A tiny, randomly initialised Qwen3.5 vision-language checkpoint for tests.

The directory looks like an mlx-community Qwen3.5 VLM conversion (MLX weight layout) with a
native MTP head, and loads in the real libraries on MLX's CPU backend: `mlx_vlm.load`,
`vllm_mlx.text_model_from_vlm.build_text_model` (with MTP injection) and `vllm-mlx serve
--mllm`. Nothing is downloaded; the tokenizer is trained here (see tokenizer_builder).

Layout (MLX, as mlx_vlm.convert writes it, so no loader conversion applies):
  language_model.model.embed_tokens.weight
  language_model.model.layers.{i}.linear_attn.*   gated delta net, (i+1) % interval != 0
  language_model.model.layers.{i}.self_attn.*     gated full attention, (i+1) % interval == 0
  language_model.model.norm.weight, language_model.lm_head.weight
  vision_tower.*                                   Qwen3-VL tower without deepstack
RMSNorm weights are MLX gamma (~1.0), conv1d is [C, K, 1], the Conv3d patch embedding is
[out, T, H, W, C].

MTP placements (keys relative to the head are "mtp.*"):
  subdir     mtp/weights.safetensors + mtp/manifest.json (declares MLX-gamma norms); the file
             vllm_mlx's inject_mtp_support reads first, invisible to mlx_vlm's glob.
  model-mtp  model-mtp.safetensors in the model dir (inject_mtp_support's fallback). mlx_lm.load
             globs it and, seeing "mtp." keys, adds +1 to every RMSNorm (wrong logits).
  main       language_model.mtp.* inside model.safetensors and its index. build_text_model finds
             them through the index but drops them; inject_mtp_support never reads them.
  none       no MTP weights (config still declares mtp_num_hidden_layers).

Quantized (8-bit, 4-bit, mixed 4/8-bit) and raw-HF checkpoints, and mlx-vlm's separate drafter
folder, are made from this one by `checkpoint_variants` with mlx-vlm's own convert and MTP split.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from .tokenizer_builder import SPECIAL_TOKENS, build_tokenizer, copy_tokenizer

logger = logging.getLogger(__name__)

MTP_PLACEMENTS = ("subdir", "model-mtp", "main", "none")
_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16",
}  # fmt: skip

# Vision tower: 16-pixel patches merged 2x2, so a 32x32 image is one merged token.
_VISION = dict(depth=2, hidden_size=32, num_heads=2, pos_grid=16, patch_size=16, merge=2, temporal=2)
_MIN_PIXELS, _MAX_PIXELS = 32 * 32, 256 * 256


def canonical_dtype(dtype: str) -> str:
    try:
        return _DTYPE_ALIASES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(set(_DTYPE_ALIASES.values()))}") from None


def _config(dims: dict, ids: dict[str, int], dtype: str, vision: dict) -> dict:
    n_layers, interval = dims["num_layers"], dims["full_attention_interval"]
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if "full_attention" not in layer_types or "linear_attention" not in layer_types:
        raise ValueError(f"{n_layers} layers with full_attention_interval {interval} is not hybrid")
    # Qwen3.5 rotates a quarter of each head; M-RoPE splits the rotated half into t/h/w sections.
    half = int(dims["head_dim"] * 0.25) // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    text_config = {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "dtype": dtype,
        "eos_token_id": ids["<|endoftext|>"],
        "full_attention_interval": interval,
        "head_dim": dims["head_dim"],
        "hidden_act": "silu",
        "hidden_size": dims["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": dims["intermediate_size"],
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": dims["linear_head_dim"],
        "linear_num_key_heads": dims["linear_key_heads"],
        "linear_num_value_heads": dims["linear_value_heads"],
        "linear_value_head_dim": dims["linear_head_dim"],
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 32768,
        "mtp_num_hidden_layers": dims["mtp_layers"],
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": dims["num_heads"],
        "num_hidden_layers": n_layers,
        "num_key_value_heads": dims["num_kv_heads"],
        "pad_token_id": None,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": mrope_section,
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": dims["vocab_size"],
    }
    v = vision
    vision_config = {
        "model_type": "qwen3_5",
        "deepstack_visual_indexes": [],
        "depth": v["depth"],
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": v["hidden_size"],
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 2 * v["hidden_size"],
        "num_heads": v["num_heads"],
        "num_position_embeddings": v["pos_grid"] ** 2,
        "out_hidden_size": dims["hidden_size"],
        "patch_size": v["patch_size"],
        "spatial_merge_size": v["merge"],
        "temporal_patch_size": v["temporal"],
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "tie_word_embeddings": False,
        "transformers_version": "5.0.0",
        "text_config": text_config,
        "vision_config": vision_config,
    }


class _Init:
    """Random float32 tensors from one seeded generator (the same values for every dtype)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def normal(self, shape, std: float) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def linear(self, out_f: int, in_f: int) -> np.ndarray:
        return self.normal((out_f, in_f), 1.0 / math.sqrt(in_f))

    def norm(self, n: int) -> np.ndarray:
        return 1.0 + self.normal((n,), 0.02)

    def bias(self, n: int) -> np.ndarray:
        return self.normal((n,), 0.02)


def _attention(init: _Init, p: str, t: dict) -> dict:
    H, hd = t["hidden_size"], t["head_dim"]
    nH, nKV = t["num_attention_heads"], t["num_key_value_heads"]
    return {
        f"{p}.self_attn.q_proj.weight": init.linear(2 * nH * hd, H),  # queries and output gate
        f"{p}.self_attn.k_proj.weight": init.linear(nKV * hd, H),
        f"{p}.self_attn.v_proj.weight": init.linear(nKV * hd, H),
        f"{p}.self_attn.o_proj.weight": init.linear(H, nH * hd),
        f"{p}.self_attn.q_norm.weight": init.norm(hd),
        f"{p}.self_attn.k_norm.weight": init.norm(hd),
    }


def _gated_delta(init: _Init, p: str, t: dict) -> dict:
    H, K = t["hidden_size"], t["linear_conv_kernel_dim"]
    nV = t["linear_num_value_heads"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_dim = nV * t["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    return {
        f"{p}.linear_attn.in_proj_qkv.weight": init.linear(conv_dim, H),
        f"{p}.linear_attn.in_proj_z.weight": init.linear(value_dim, H),
        f"{p}.linear_attn.in_proj_b.weight": init.linear(nV, H),
        f"{p}.linear_attn.in_proj_a.weight": init.linear(nV, H),
        f"{p}.linear_attn.conv1d.weight": init.normal((conv_dim, K, 1), 1.0 / math.sqrt(K)),
        f"{p}.linear_attn.dt_bias": np.ones((nV,), np.float32),
        # Decay rates between 1 and 16, as in Qwen's initialisation; kept float32 on disk.
        f"{p}.linear_attn.A_log": np.log(init.rng.uniform(1.0, 16.0, (nV,))).astype(np.float32),
        f"{p}.linear_attn.norm.weight": init.norm(t["linear_value_head_dim"]),
        f"{p}.linear_attn.out_proj.weight": init.linear(H, value_dim),
    }


def _mlp_and_norms(init: _Init, p: str, t: dict) -> dict:
    H, I = t["hidden_size"], t["intermediate_size"]  # noqa: E741
    return {
        f"{p}.input_layernorm.weight": init.norm(H),
        f"{p}.post_attention_layernorm.weight": init.norm(H),
        f"{p}.mlp.gate_proj.weight": init.linear(I, H),
        f"{p}.mlp.up_proj.weight": init.linear(I, H),
        f"{p}.mlp.down_proj.weight": init.linear(H, I),
    }


def _language_weights(init: _Init, t: dict, zero_logit_ids: list[int], logit_scale: float) -> dict:
    H, V = t["hidden_size"], t["vocab_size"]
    lm = "language_model.model"
    w = {f"{lm}.embed_tokens.weight": init.normal((V, H), 0.5)}
    for i, kind in enumerate(t["layer_types"]):
        p = f"{lm}.layers.{i}"
        w.update(_gated_delta(init, p, t) if kind == "linear_attention" else _attention(init, p, t))
        w.update(_mlp_and_norms(init, p, t))
    w[f"{lm}.norm.weight"] = init.norm(H)
    # Logits spread with std ~logit_scale; a zeroed row sits at logit 0, far below the
    # maximum, so greedy decoding never picks it and sampling almost never does. Zeroed:
    # special tokens (so a random model does not stop or open vision blocks at once) and
    # padding ids past the tokenizer (they have no string; mlx_vlm's detokenizer would
    # raise IndexError on one).
    lm_head = init.normal((V, H), logit_scale / math.sqrt(H))
    lm_head[zero_logit_ids] = 0.0
    w["language_model.lm_head.weight"] = lm_head
    return w


def _vision_weights(init: _Init, v: dict, out_hidden: int) -> dict:
    Vh, Vi = v["hidden_size"], v["intermediate_size"]
    ps, tps, C = v["patch_size"], v["temporal_patch_size"], v["in_channels"]
    merged = Vh * v["spatial_merge_size"] ** 2
    vt = "vision_tower"
    w = {
        f"{vt}.patch_embed.proj.weight": init.normal((Vh, tps, ps, ps, C), 1.0 / math.sqrt(tps * ps * ps * C)),
        f"{vt}.patch_embed.proj.bias": init.bias(Vh),
        f"{vt}.pos_embed.weight": init.normal((v["num_position_embeddings"], Vh), 0.02),
    }
    for b in range(v["depth"]):
        p = f"{vt}.blocks.{b}"
        w.update(
            {
                f"{p}.norm1.weight": init.norm(Vh),
                f"{p}.norm1.bias": init.bias(Vh),
                f"{p}.norm2.weight": init.norm(Vh),
                f"{p}.norm2.bias": init.bias(Vh),
                f"{p}.attn.qkv.weight": init.linear(3 * Vh, Vh),
                f"{p}.attn.qkv.bias": init.bias(3 * Vh),
                f"{p}.attn.proj.weight": init.linear(Vh, Vh),
                f"{p}.attn.proj.bias": init.bias(Vh),
                f"{p}.mlp.linear_fc1.weight": init.linear(Vi, Vh),
                f"{p}.mlp.linear_fc1.bias": init.bias(Vi),
                f"{p}.mlp.linear_fc2.weight": init.linear(Vh, Vi),
                f"{p}.mlp.linear_fc2.bias": init.bias(Vh),
            }
        )
    w.update(
        {
            f"{vt}.merger.norm.weight": init.norm(Vh),
            f"{vt}.merger.norm.bias": init.bias(Vh),
            f"{vt}.merger.linear_fc1.weight": init.linear(merged, merged),
            f"{vt}.merger.linear_fc1.bias": init.bias(merged),
            f"{vt}.merger.linear_fc2.weight": init.linear(out_hidden, merged),
            f"{vt}.merger.linear_fc2.bias": init.bias(out_hidden),
        }
    )
    return w


def _mtp_weights(init: _Init, t: dict) -> dict:
    """Qwen3.5's native MTP head, keys relative to "mtp."."""
    H = t["hidden_size"]
    w = {
        "pre_fc_norm_hidden.weight": init.norm(H),
        "pre_fc_norm_embedding.weight": init.norm(H),
        "fc.weight": init.linear(H, 2 * H),  # input: concat(normed embedding, normed hidden)
        "norm.weight": init.norm(H),
    }
    for j in range(t["mtp_num_hidden_layers"]):
        w.update(_attention(init, f"layers.{j}", t))
        w.update(_mlp_and_norms(init, f"layers.{j}", t))
    return w


def _processor_configs(v: dict) -> dict[str, dict]:
    common = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": v["spatial_merge_size"],
        "patch_size": v["patch_size"],
        "temporal_patch_size": v["temporal_patch_size"],
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": _MAX_PIXELS, "shortest_edge": _MIN_PIXELS},
    }
    return {
        "preprocessor_config.json": {
            **common,
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
        },
        "video_preprocessor_config.json": {
            **common,
            "fps": 2,
            "min_frames": 4,
            "max_frames": 16,
            "do_sample_frames": True,
            "video_processor_type": "Qwen3VLVideoProcessor",
            "processor_class": "Qwen3VLProcessor",
        },
        "processor_config.json": {"processor_class": "Qwen3VLProcessor"},
    }


def _save(path: Path, arrays: dict[str, np.ndarray], dtype: str) -> int:
    import mlx.core as mx

    target = getattr(mx, dtype)
    # A_log stays float32 like real conversions (mlx's cast_predicate skips it too).
    out = {k: mx.array(a) if k.endswith("A_log") else mx.array(a).astype(target) for k, a in arrays.items()}
    mx.save_safetensors(str(path), out, metadata={"format": "mlx"})
    return sum(a.nbytes for a in out.values())


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def build_tiny_qwen35_vlm(
    out_dir: Path,
    *,
    dtype: str = "float32",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 4,
    full_attention_interval: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    linear_key_heads: int = 2,
    linear_value_heads: int = 4,
    linear_head_dim: int = 16,
    mtp_layers: int = 1,
    vocab_size: int = 4096,
    seed: int = 0,
    mtp_placement: str = "subdir",
    tokenizer_from: Path | None = None,
    force: bool = False,
    logit_scale: float = 4.0,
    zero_special_logits: bool = True,
    vision: dict | None = None,
) -> dict:
    """Write a tiny random Qwen3.5 VLM checkpoint into `out_dir`; returns a summary dict.

    Weights depend only on the sizes and `seed` (drawn in float32, then cast), so the
    bfloat16 build is the float32 build rounded. `tokenizer_from` copies the tokenizer of
    an existing checkpoint (or `build_tokenizer` output) instead of training one; it may
    be `out_dir` itself with `force=True`, to redraw the weights under the same tokenizer.
    `zero_special_logits=False` keeps random lm_head rows for special tokens, so EOS can
    be generated; padding ids past the tokenizer are always zeroed. `vision` overrides the vision tower's sizes
    (`_VISION`'s keys: `depth`, `hidden_size`, `num_heads`, ...).
    """
    dtype = canonical_dtype(dtype)
    if mtp_placement not in MTP_PLACEMENTS:
        raise ValueError(f"mtp_placement {mtp_placement!r} not in {MTP_PLACEMENTS}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty (use force=True)")
    dims = dict(
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_layers=num_layers,
        full_attention_interval=full_attention_interval, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, linear_key_heads=linear_key_heads, linear_value_heads=linear_value_heads,
        linear_head_dim=linear_head_dim, mtp_layers=mtp_layers, vocab_size=vocab_size,
    )  # fmt: skip

    # Build beside the target and rename at the end: a reader never sees a half-written
    # checkpoint, and tokenizer_from may point at out_dir itself.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    work.chmod(0o755)
    try:
        if tokenizer_from is not None:
            tok = copy_tokenizer(Path(tokenizer_from), work)
        else:
            tok = build_tokenizer(work, bpe_vocab=min(4000, vocab_size - 96))
        if tok["tokenizer_size"] > vocab_size:
            raise ValueError(f"tokenizer has {tok['tokenizer_size']} tokens > vocab_size {vocab_size}")
        ids = tok["special_ids"]

        cfg = _config(dims, ids, dtype, {**_VISION, **(vision or {})})
        t, v = cfg["text_config"], cfg["vision_config"]
        _write_json(work / "config.json", cfg)
        _write_json(
            work / "generation_config.json",
            {
                "bos_token_id": ids["<|endoftext|>"],
                "eos_token_id": cfg["eos_token_id"],
                "pad_token_id": ids["<|endoftext|>"],
                "transformers_version": "5.0.0",
            },
        )
        for name, obj in _processor_configs(v).items():
            _write_json(work / name, obj)

        zero_ids = list(range(tok["tokenizer_size"], vocab_size))
        if zero_special_logits:
            zero_ids += [ids[s] for s in SPECIAL_TOKENS]
        init = _Init(seed)
        language = _language_weights(init, t, sorted(zero_ids), logit_scale)
        vision = _vision_weights(init, v, hidden_size)
        mtp = {f"mtp.{k}": a for k, a in _mtp_weights(init, t).items()}

        main = {**language, **vision}
        if mtp_placement == "main":
            main.update({f"language_model.{k}": a for k, a in mtp.items()})
        total = _save(work / "model.safetensors", main, dtype)
        _write_json(
            work / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": {k: "model.safetensors" for k in sorted(main)}},
        )
        if mtp_placement == "subdir":
            (work / "mtp").mkdir()
            _save(work / "mtp" / "weights.safetensors", mtp, dtype)
            # Without this manifest inject_mtp_support guesses the norm convention from means.
            _write_json(
                work / "mtp" / "manifest.json",
                {"artifact_schema_version": 1, "rmsnorm_weight_format": "mlx_gamma", "num_layers": mtp_layers},
            )
        elif mtp_placement == "model-mtp":
            _save(work / "model-mtp.safetensors", mtp, dtype)

        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise

    def count(ws: dict, prefix: str) -> int:
        return sum(a.size for k, a in ws.items() if k.startswith(prefix))

    info = {
        "out": str(out_dir),
        "dtype": dtype,
        "mtp_placement": mtp_placement,
        "vocab_size": vocab_size,
        "tokenizer_size": tok["tokenizer_size"],
        "special_ids": ids,
        "eos_token_id": tok["eos_token_id"],
        "pad_token_id": tok["pad_token_id"],
        "zero_logit_ids": sorted(zero_ids),
        "params_language": count(language, "language_model."),
        "params_vision": count(vision, "vision_tower."),
        "params_mtp": sum(a.size for a in mtp.values()) if mtp_placement != "none" else 0,
        "dir_bytes": sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file()),
    }
    logger.debug("built tiny Qwen3.5 VLM: %s", info)
    return info


def tiny_model_dir(tmp_root: Path, dtype: str = "float32", placement: str = "subdir") -> Path:
    """The default tiny model for (dtype, placement) under `tmp_root`, built on first use.

    The tokenizer is trained once per `tmp_root` and copied into every build.
    """
    tmp_root = Path(tmp_root)
    dtype = canonical_dtype(dtype)
    out = tmp_root / f"tiny-qwen35-{dtype}-{placement}"
    if (out / "config.json").exists():
        return out
    tok_dir = tmp_root / "tokenizer"
    tmp_root.mkdir(parents=True, exist_ok=True)
    if not (tok_dir / "tokenizer.json").exists():
        # Trained beside and renamed, so a concurrent reader never sees a partial one.
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=tmp_root))
        build_tokenizer(staging)
        try:
            os.replace(staging, tok_dir)
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    build_tiny_qwen35_vlm(out, dtype=dtype, mtp_placement=placement, tokenizer_from=tok_dir, force=True)
    return out


def with_context(model: Path, out: Path, context_tokens: int) -> Path:
    """``model`` seen through a config whose text model has a context of ``context_tokens`` (its
    ``max_position_embeddings``): its other files linked, not copied. Tests of what fits the context take it."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in model.iterdir():
        if entry.name != "config.json" and not (out / entry.name).exists():
            (out / entry.name).symlink_to(entry.resolve())
    config = json.loads((model / "config.json").read_text())
    config.setdefault("text_config", {})["max_position_embeddings"] = context_tokens
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="PYTHONPATH=tests python -m support.tiny_model",
        description="Write a tiny random Qwen3.5 VLM checkpoint (offline).",
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="float32", choices=sorted(_DTYPE_ALIASES))
    ap.add_argument("--mtp-placement", default="subdir", choices=MTP_PLACEMENTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--mtp-layers", type=int, default=1)
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="copy this dir's tokenizer instead of training")
    ap.add_argument("--keep-special-logits", action="store_true", help="let the model generate special tokens (EOS)")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    a = ap.parse_args(argv)
    try:
        info = build_tiny_qwen35_vlm(
            a.out,
            dtype=a.dtype,
            mtp_placement=a.mtp_placement,
            seed=a.seed,
            hidden_size=a.hidden_size,
            num_layers=a.num_layers,
            vocab_size=a.vocab_size,
            mtp_layers=a.mtp_layers,
            tokenizer_from=a.tokenizer_from,
            zero_special_logits=not a.keep_special_logits,
            force=a.force,
        )
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info.pop("zero_logit_ids")
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
