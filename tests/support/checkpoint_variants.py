"""Checkpoints as users have them: a raw Hugging Face Qwen3.5 layout and its MLX conversions,
bf16 or quantized, with the MTP head in every place the tools put it.

Built from any MLX-layout Qwen3.5 VLM (the tiny builder's output or the committed trained model):

  1. `export_raw_hf` writes what the Hub ships: HF key names (`model.language_model.*`,
     `model.visual.*`, `lm_head.weight`), top-level `mtp.*` in the main shard, zero-centred RMSNorm
     weights (the module computes x * (1 + w)), PyTorch conv layouts, `format: pt` metadata; an MoE model's
     experts fused (`experts.gate_up_proj`, `experts.down_proj`, as Qwen3.5-MoE ships) or per expert
     (`experts.{e}.{gate,up,down}_proj.weight`, as Qwen3-Next ships).
  2. `convert_with_mlx_vlm` runs mlx-vlm 0.7.10's own `convert` on it (dtype cast, quantization with
     any bits/group size or a mixed recipe, `--mtp` drafter extraction by its qwen3_5_mtp splitter):
     the converted model carries no MTP tensors and the drafter folder (`model_type: qwen3_5_mtp`) is
     what `--mllm-draft-model PATH --mllm-draft-kind mtp` takes.
  3. `place_mtp` puts the drafter's tensors (bf16 or quantized, as the splitter wrote them) where the
     other tools do: `mtp/weights.safetensors`, `model-mtp.safetensors` (vllm-mlx's tooling),
     `mtp.safetensors` (mlx-lm's proposed --preserve-mtp, layout "mtp-file"), or `mtp.*` keys in the
     main shard beside the backbone.

`variant(root, layout, precision)` builds one (layout, precision) cell once per `root`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

EXPERT_LAYOUTS = ("fused", "per-expert")
LAYOUTS = ("subdir", "model-mtp", "mtp-file", "main", "drafter", "none")
# precision -> mlx-vlm convert arguments
PRECISIONS: dict[str, dict] = {
    "bf16": {},
    "8bit": {"quantize": True, "q_bits": 8, "q_group_size": 64},
    "4bit": {"quantize": True, "q_bits": 4, "q_group_size": 32},
    "mixed": {"quantize": True, "q_bits": 4, "q_group_size": 64, "quant_predicate": "mixed_4_8"},
}

# RMSNorms Qwen3.5's HF checkpoints store zero-centred (linear_attn.norm is a plain gated norm).
_HF_OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_MTP_OFFSET_NORMS = _HF_OFFSET_NORMS + ("pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight")
_COPIED = (".json", ".jinja", ".txt", ".model")


@dataclass(frozen=True)
class Variant:
    model: Path  # what `vllm-mlx serve` is given
    drafter: Path | None  # the `--mllm-draft-model` folder (layout "drafter")
    layout: str
    precision: str

    def serve_flags(self) -> tuple[str, ...]:
        return ("--mllm-draft-model", str(self.drafter), "--mllm-draft-kind", "mtp") if self.drafter else ()


def _mtp_tensors(src: Path) -> dict:
    import mlx.core as mx

    for rel in ("mtp/weights.safetensors", "model-mtp.safetensors", "mtp.safetensors"):
        if (src / rel).exists():
            return {k.removeprefix("mtp."): v for k, v in mx.load(str(src / rel)).items()}
    return {k.removeprefix("language_model.mtp."): v for k, v in mx.load(str(src / "model.safetensors")).items()
            if k.startswith("language_model.mtp.")}


def _hf_key(key: str) -> str | None:
    if key.startswith("language_model.model."):
        return "model.language_model." + key[len("language_model.model.") :]
    if key == "language_model.lm_head.weight":
        return "lm_head.weight"
    if key.startswith("vision_tower."):
        return "model.visual." + key[len("vision_tower.") :]
    return None  # language_model.mtp.*: written separately


def _hf_experts(weights: dict, experts: str) -> dict:
    """MLX `switch_mlp.*` stacks as the Hub has them: "fused" (Qwen3.5-MoE's `experts.gate_up_proj`
    [E, 2I, H] and `experts.down_proj` [E, H, I]) or "per-expert" (`experts.{e}.{proj}.weight`)."""
    import mlx.core as mx

    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts {experts!r} not in {EXPERT_LAYOUTS}")
    out = {}
    for key, value in weights.items():
        base, _, rest = key.partition(".switch_mlp.")
        if not rest:
            out[key] = value
        elif experts == "per-expert":
            proj = rest.removesuffix(".weight")
            out.update({f"{base}.experts.{e}.{proj}.weight": value[e] for e in range(value.shape[0])})
        elif rest == "down_proj.weight":
            out[f"{base}.experts.down_proj"] = value
        elif rest == "gate_proj.weight":
            out[f"{base}.experts.gate_up_proj"] = mx.concatenate([value, weights[f"{base}.switch_mlp.up_proj.weight"]], axis=-2)
    return out


def export_raw_hf(src: Path, out: Path, *, dtype: str = "bfloat16", experts: str = "fused") -> Path:
    """Write the MLX-layout Qwen3.5 VLM at `src` as a raw HF checkpoint (MTP in the main shard); an MoE
    model's experts in the `experts` layout."""
    import mlx.core as mx

    target = getattr(mx, dtype)
    weights: dict[str, mx.array] = {}
    for key, value in mx.load(str(src / "model.safetensors")).items():
        if (hf := _hf_key(key)) is None:
            continue
        if hf.endswith(_HF_OFFSET_NORMS) or hf == "model.language_model.norm.weight":
            value = value - 1.0
        if "conv1d.weight" in hf:  # MLX [C, K, 1] -> PyTorch [C, 1, K]
            value = value.moveaxis(2, 1)
        if hf.endswith("patch_embed.proj.weight"):  # MLX NDHWC -> PyTorch NCDHW
            value = value.transpose(0, 4, 1, 2, 3)
        weights[hf] = value
    for key, value in _mtp_tensors(src).items():
        weights[f"mtp.{key}"] = value - 1.0 if value.ndim == 1 and (key == "norm.weight" or key.endswith(_MTP_OFFSET_NORMS)) else value
    weights = {k: v if k.endswith("A_log") else v.astype(target) for k, v in _hf_experts(weights, experts).items()}

    out.mkdir(parents=True, exist_ok=True)
    shard = "model-00001-of-00001.safetensors"
    mx.save_safetensors(str(out / shard), weights, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": {k: shard for k in sorted(weights)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.suffix in _COPIED and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config["text_config"]["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def convert_with_mlx_vlm(hf: Path, out: Path, drafter: Path, precision: str) -> None:
    """mlx-vlm's own conversion, as `python -m mlx_vlm.convert --hf-path HF --mlx-path OUT --mtp
    --mtp-output DRAFTER [-q --q-bits B --q-group-size G | --quant-predicate mixed_4_8]`."""
    from mlx_vlm.convert import convert

    with contextlib.redirect_stdout(io.StringIO()):  # progress lines
        convert(str(hf), str(out), dtype="bfloat16", mtp=True, mtp_output=str(drafter), **PRECISIONS[precision])
    if not (drafter / "config.json").exists():
        raise RuntimeError(f"mlx-vlm convert wrote no MTP drafter for {hf}")


def place_mtp(model: Path, drafter: Path, layout: str) -> None:
    """Put the drafter's MTP tensors (keys relative to the head) where `layout` says."""
    import mlx.core as mx

    if layout in ("drafter", "none"):
        return
    tensors = {f"mtp.{k}": v for k, v in mx.load(str(drafter / "model.safetensors")).items()}
    if layout == "subdir":
        (model / "mtp").mkdir(exist_ok=True)
        mx.save_safetensors(str(model / "mtp" / "weights.safetensors"), tensors, metadata={"format": "mlx"})
    elif layout in ("model-mtp", "mtp-file"):
        name = "model-mtp.safetensors" if layout == "model-mtp" else "mtp.safetensors"
        mx.save_safetensors(str(model / name), tensors, metadata={"format": "mlx"})
    elif layout == "main":
        index_path = model / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        shard = sorted(set(index["weight_map"].values()))[-1]
        merged = dict(mx.load(str(model / shard)))
        merged.update(tensors)
        mx.save_safetensors(str(model / shard), merged, metadata={"format": "mlx"})
        index["weight_map"].update({k: shard for k in tensors})
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    else:
        raise ValueError(f"layout {layout!r} not in {LAYOUTS}")


def staged(final: Path, build) -> Path:
    """Build into a sibling temp dir and rename, so a concurrent reader never sees half a checkpoint."""
    if final.exists():
        return final
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(work)
        os.replace(work, final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return final


def variant(root: Path, source: Path, layout: str, precision: str) -> Variant:
    """The (layout, precision) checkpoint made from the MLX-layout model `source`, built once under `root`.

    precision "bf16" with layout "main" is the raw HF checkpoint itself (served as is); every other
    cell is an mlx-vlm conversion of it with the MTP head placed per layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} not in {LAYOUTS}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} not in {sorted(PRECISIONS)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    hf = staged(root / "raw-hf", lambda d: export_raw_hf(Path(source), d))
    if layout == "main" and precision == "bf16":
        return Variant(hf, None, layout, precision)

    def convert(d: Path) -> None:
        d.mkdir(exist_ok=True)
        convert_with_mlx_vlm(hf, d / "model", d / "drafter", precision)

    converted = staged(root / f"converted-{precision}", convert)
    drafter = converted / "drafter"

    def copy(d: Path) -> None:
        shutil.copytree(converted / "model", d, dirs_exist_ok=True)
        place_mtp(d, drafter, layout)

    model = converted / "model" if layout in ("drafter", "none") else staged(root / f"{layout}-{precision}", copy)
    return Variant(model, drafter if layout == "drafter" else None, layout, precision)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(
        prog="PYTHONPATH=tests python -m support.checkpoint_variants",
        description="Write a raw-HF export of an MLX Qwen3.5 VLM and its mlx-vlm conversion with the MTP head in one layout.",
    )
    ap.add_argument("source", type=Path, help="an MLX-layout Qwen3.5 VLM with an MTP head (e.g. the tiny builder's output)")
    ap.add_argument("root", type=Path, help="directory for the builds (reused across calls)")
    ap.add_argument("--layout", choices=LAYOUTS, default="subdir")
    ap.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16")
    a = ap.parse_args(argv)
    try:
        v = variant(a.root, a.source, a.layout, a.precision)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"model": str(v.model), "drafter": str(v.drafter) if v.drafter else None, "serve_flags": list(v.serve_flags())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
