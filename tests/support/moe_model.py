"""A tiny Qwen3.5-MoE vision-language checkpoint, made from a dense MLX-layout Qwen3.5 VLM.

Every dense MLP (the backbone's and the MTP head's) becomes a sparse MoE block as Qwen3.5-35B-A3B has it: a
router over `num_experts` experts of which `experts_per_tok` run per token, plus a shared expert behind a
sigmoid gate. The dense function is kept, so a trained source keeps its MTP head's acceptance:

  shared expert   the MLP's first `shared` intermediate channels, down projection x2 (its gate's weight
                  is zero: sigmoid(0) = 1/2)
  each expert     the remaining channels plus seeded noise (`noise` times each tensor's std), so experts
                  differ and the router's choice changes the output a little
  router          random; top-k scores renormalized to sum to 1 (norm_topk_prob), so the k experts'
                  weighted sum is the remaining channels' output up to the noise.

The result is MLX layout (`switch_mlp.{gate,up,down}_proj` stacked over experts, as mlx-vlm's convert
writes it) with the MTP head in mtp/weights.safetensors; `checkpoint_variants.export_raw_hf` writes its
raw Hugging Face layouts (fused `experts.gate_up_proj`, or per-expert tensors).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

_DENSE_MLP = re.compile(r"(.*\.mlp)\.(gate_proj|up_proj|down_proj)\.weight$")
_COPIED = (".json", ".jinja", ".txt", ".model")


def _moe_block(base: str, dense: dict[str, np.ndarray], n: int, shared: int, noise: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    gate, up, down = dense["gate_proj"], dense["up_proj"], dense["down_proj"]  # [I, H], [I, H], [H, I]
    H = gate.shape[1]

    def experts(w: np.ndarray, axis: int) -> np.ndarray:
        part = w[shared:] if axis == 0 else w[:, shared:]
        return np.stack([part + rng.standard_normal(part.shape).astype(np.float32) * noise * part.std() for _ in range(n)])

    return {
        f"{base}.gate.weight": (rng.standard_normal((n, H)) / np.sqrt(H)).astype(np.float32),
        f"{base}.switch_mlp.gate_proj.weight": experts(gate, 0),
        f"{base}.switch_mlp.up_proj.weight": experts(up, 0),
        f"{base}.switch_mlp.down_proj.weight": experts(down, 1),
        f"{base}.shared_expert.gate_proj.weight": gate[:shared],
        f"{base}.shared_expert.up_proj.weight": up[:shared],
        f"{base}.shared_expert.down_proj.weight": 2.0 * down[:, :shared],
        f"{base}.shared_expert_gate.weight": np.zeros((1, H), np.float32),
    }


def _to_moe(weights: dict[str, np.ndarray], n: int, shared: int, noise: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    blocks: dict[str, dict[str, np.ndarray]] = {}
    for key, value in weights.items():
        if m := _DENSE_MLP.fullmatch(key):
            blocks.setdefault(m[1], {})[m[2]] = value
        else:
            out[key] = value
    for base in sorted(blocks, key=lambda b: [int(t) if t.isdigit() else t for t in b.split(".")]):
        out.update(_moe_block(base, blocks[base], n, shared, noise, rng))
    return out


def _moe_config(config: dict, n: int, k: int, shared: int, moe: int, dtype: str) -> dict:
    config = json.loads(json.dumps(config))
    text = config["text_config"]
    text.pop("intermediate_size", None)  # Qwen3.5-MoE configs have none: every layer is sparse
    text.update({
        "model_type": "qwen3_5_moe_text", "dtype": dtype, "num_experts": n, "num_experts_per_tok": k,
        "moe_intermediate_size": moe, "shared_expert_intermediate_size": shared, "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
    })  # fmt: skip
    config["model_type"] = "qwen3_5_moe"
    config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    config["vision_config"]["model_type"] = "qwen3_5_moe"
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return config


def moe_from_dense(
    src: Path, out: Path, *, num_experts: int = 4, experts_per_tok: int = 2, shared_fraction: float = 1 / 3,
    noise: float = 0.02, seed: int = 0, dtype: str = "float32",
) -> Path:
    """Write the MoE version of the dense MLX-layout Qwen3.5 VLM at `src` into `out` (built beside, renamed)."""
    import mlx.core as mx

    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    intermediate = int(config["text_config"]["intermediate_size"])
    shared = max(1, round(intermediate * shared_fraction))
    if not 0 < shared < intermediate or not 0 < experts_per_tok <= num_experts:
        raise ValueError(f"cannot split {intermediate} channels with shared {shared}, top-{experts_per_tok} of {num_experts}")
    rng = np.random.default_rng(seed)

    def numpy(path: Path) -> dict[str, np.ndarray]:
        return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path)).items()}

    def save(path: Path, arrays: dict[str, np.ndarray]) -> int:
        target = getattr(mx, dtype)
        converted = {k: mx.array(v) if k.endswith("A_log") else mx.array(v).astype(target) for k, v in arrays.items()}
        mx.save_safetensors(str(path), converted, metadata={"format": "mlx"})
        return sum(v.nbytes for v in converted.values())

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    work.chmod(0o755)
    try:
        main = _to_moe(numpy(src / "model.safetensors"), num_experts, shared, noise, rng)
        total = save(work / "model.safetensors", main)
        index = {"metadata": {"total_size": total}, "weight_map": {k: "model.safetensors" for k in sorted(main)}}
        (work / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if (src / "mtp" / "weights.safetensors").exists():
            (work / "mtp").mkdir()
            save(work / "mtp" / "weights.safetensors", _to_moe(numpy(src / "mtp" / "weights.safetensors"), num_experts, shared, noise, rng))
            shutil.copy(src / "mtp" / "manifest.json", work / "mtp" / "manifest.json")
        for f in src.iterdir():
            if f.is_file() and f.suffix in _COPIED and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(f, work / f.name)
        moe_config = _moe_config(config, num_experts, experts_per_tok, shared, intermediate - shared, dtype)
        (work / "config.json").write_text(json.dumps(moe_config, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out
