#!/usr/bin/env python3
"""SpecPrefill speed: time to first token, dense prefill vs SpecPrefill, on the text engine.

For each prompt length and each draft, in process (``BatchScheduler``, greedy, max_tokens 1, the target in
--prefill-step-size chunks both ways, the draft in the chunks the engine gives it):
  dense      the scheduler prefills the whole prompt and samples the first token;
  sparse     the same scheduler with its ``SpecPrefill`` as the server runs it (the draft scores the prompt: its
             prefill in chunks, the look-ahead, the chunk selection; the kept tokens prefilled at their own positions;
             the first token sampled), scoring timed apart (the engine's ``scoring_s``).
The draft cost is the scoring time, the target cost the dense TTFT; the ideal speedup is
1 / (keep + draft_cost / target_cost), efficiency = measured speedup / ideal.

Models: checkpoints (--model, --draft: loaded as the server loads them) or random weights built in
memory from a named shape (--target-shape, --draft-shapes), bf16 by default:
  qwen35-9b     Qwen3.5-9B's text shape: hidden 4096, 32 layers ([GDN x3, attention] x8), MLP 12288,
                16 / 4 attention heads of 256, GDN 16 key / 32 value heads of 128, vocab 248320 (untied)
  qwen35-0.5b   a Qwen3.5 draft: hidden 1024, 12 layers ([GDN x3, attention] x3), MLP 3584, 8 / 2 heads of
                256, GDN 16 / 16 heads of 128, vocab 248320 tied (Qwen3.5-0.8B's layers, half as many)
  attn-0.5b     an attention-only (qwen3) draft: hidden 1024, 16 layers, MLP 3072, 16 / 8 heads of 128,
                vocab 248320 tied: no gated-delta layer, so its prefill is matmuls only
  small, small-draft, small-attn    tiny versions of the three (--smoke)
Random-weight prompts are random token ids; checkpoint prompts are held-out standard-library text.

Lengths run in the order given; before each (length, draft) unit the remaining --budget-s is checked
against an estimate from what was measured so far, and what does not fit is skipped and listed.
Results are written after every unit (a timeout keeps what finished).

  python benchmarks/specprefill_speed.py --smoke                                     # CPU logic check
  python benchmarks/specprefill_speed.py --model models/tiny-qwen35-trained --draft models/tiny-qwen35-draft \\
      --lengths 1024,2048 --dtype float32                                            # CPU, trained model
  python benchmarks/specprefill_speed.py --target-shape qwen35-9b --draft-shapes qwen35-0.5b,attn-0.5b \\
      --lengths 8192,16384,32768 --out $OUT/specprefill_speed-gpu.json               # GPU (gpu_specprefill.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINED = REPO / "models" / "tiny-qwen35-trained"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

QWEN35 = {"model_type": "qwen3_5_text", "hidden_act": "silu", "rms_norm_eps": 1e-6, "attn_output_gate": True,
          "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                              "mrope_interleaved": True, "mrope_section": [11, 11, 10]}}  # fmt: skip
SHAPES = {
    "qwen35-9b": {**QWEN35, "hidden_size": 4096, "num_hidden_layers": 32, "full_attention_interval": 4,
                  "intermediate_size": 12288, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "vocab_size": 248320, "tie_word_embeddings": False},
    "qwen35-0.5b": {**QWEN35, "hidden_size": 1024, "num_hidden_layers": 12, "full_attention_interval": 4,
                    "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "vocab_size": 248320, "tie_word_embeddings": True},
    "attn-0.5b": {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 3072,
                  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
                  "vocab_size": 248320, "max_position_embeddings": 262144, "rope_theta": 1000000.0,
                  "tie_word_embeddings": True},
}  # fmt: skip
SHAPES["small"] = {**SHAPES["qwen35-9b"], "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                   "vocab_size": 8192}  # fmt: skip
SHAPES["small-draft"] = {**SHAPES["small"], "hidden_size": 64, "num_hidden_layers": 2, "full_attention_interval": 2,
                         "intermediate_size": 128, "tie_word_embeddings": True}  # fmt: skip
SHAPES["small-attn"] = {**SHAPES["attn-0.5b"], "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 8192}  # fmt: skip


def random_model(shape: str, dtype):
    """An mlx-lm text model of ``shape`` with mlx's default random init, cast layer by layer (no full fp32 copy)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    cfg = dict(SHAPES[shape])
    if cfg["model_type"] == "qwen3":
        from mlx_lm.models.qwen3 import Model, ModelArgs

        model = Model(ModelArgs.from_dict(cfg))
    else:
        from mlx_lm.models.qwen3_5 import TextModel, TextModelArgs

        n, k = cfg["num_hidden_layers"], cfg["full_attention_interval"]
        cfg["layer_types"] = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
        model = TextModel(TextModelArgs.from_dict(cfg))
    for layer in model.model.layers:
        layer.set_dtype(dtype)
        mx.eval(layer.parameters())
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    # A module is built in training mode; mlx-lm's load() switches to eval, and the gated-delta layer
    # picks its kernel only in eval (in training it runs the per-position loop of ops: ~30x slower
    # prefill on CUDA, which is what the first GPU run of this benchmark measured as "dense").
    model.train(False)
    if cfg["model_type"] != "qwen3":
        # As the server's text model gets in text_model.py (and a draft in scoring.prepare_draft): the fused
        # gated-delta recurrence on MLX's CUDA backend; a no-op elsewhere.
        from vllm_mlx_mtp_routing.model.kernels.swaps import use_fused_recurrence

        use_fused_recurrence(model)
    return model, sum(v.size for _, v in tree_flatten(model.parameters()))


def checkpoint_target(path: Path, dtype):
    """The checkpoint's language model as the server builds it (mlx-vlm load, the plugin's TextModel)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    vlm, _ = load(str(path))
    model = build_text_model(vlm, path, json.loads((path / "config.json").read_text()), enable_mtp=False).model
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, sum(v.size for _, v in tree_flatten(model.parameters()))


def checkpoint_draft(path: Path, dtype):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    draft = load(str(path))[0]
    draft.set_dtype(dtype)
    mx.eval(draft.parameters())
    return draft, sum(v.size for _, v in tree_flatten(draft.parameters()))


def prompt_ids(tokenizer, n: int, checkpoint: bool, seed: int) -> list[int]:
    if checkpoint:
        from specprefill_mtp import heldout_prompts

        prompts = heldout_prompts(tokenizer, 1, n)
        if prompts:
            return prompts[0]
    import numpy as np

    return np.random.default_rng(seed).integers(10, 3900, size=n).tolist()  # inside every tokenizer/vocab here


class Bench:
    def __init__(self, model, tokenizer, step: int) -> None:
        self.model, self.tokenizer, self.step = model, tokenizer, step

    def _first_token(self, prompt: list[int], specprefill=None) -> None:
        from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
        from vllm_mlx_mtp_routing.text_engine.state import TextRequest
        from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions

        sched = BatchScheduler(self.model, self.tokenizer, prefill_step_size=self.step, specprefill=specprefill)
        sched.add(TextRequest("r", prompt, SamplingOptions(max_tokens=1)))
        while sched.has_work():
            if any(o.finished for o in sched.step()):
                return
        raise RuntimeError("no first token")

    def dense(self, prompt: list[int]) -> float:
        import mlx.core as mx

        mx.clear_cache()
        tic = time.perf_counter()
        self._first_token(prompt)
        return time.perf_counter() - tic

    def sparse(self, draft, prompt: list[int], keep: float) -> dict:
        """TTFT with SpecPrefill as the server runs it (the engine's ``SpecPrefill``, every prompt token past the
        threshold), split into scoring (the draft) and the rest (sparse prefill + first token)."""
        import mlx.core as mx

        from vllm_mlx_mtp_routing.specprefill import SpecPrefill, SpecPrefillSettings

        spec = SpecPrefill(draft, SpecPrefillSettings(threshold=0, keep_pct=keep))
        mx.clear_cache()
        tic = time.perf_counter()
        self._first_token(prompt, spec)
        done = time.perf_counter()
        m = spec.metrics
        if m.requests != 1:
            raise RuntimeError(f"SpecPrefill did not engage: {m.stats()}")
        return {"ttft_s": done - tic, "scoring_s": m.scoring_s, "kept": m.tokens_kept}


def versions() -> dict:
    import mlx.core as mx

    from vllm_mlx_mtp_routing.model.kernels.device import on_cuda

    out = {"fused_gated_delta": on_cuda(), "mlx": mx.__version__, "device": str(mx.default_device()), "python": platform.python_version(),
           "machine": platform.machine(), "commit": os.environ.get("BENCH_COMMIT", "")}
    for mod in ("mlx_lm", "mlx_vlm", "vllm_mlx"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a version we cannot read is recorded as unknown
            out[mod] = "unknown"
    if mx.default_device() == mx.gpu:
        try:
            out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["gpu"] = "unknown (no nvidia-smi)"
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="target checkpoint (else --target-shape)")
    ap.add_argument("--target-shape", default="qwen35-9b", choices=sorted(SHAPES))
    ap.add_argument("--draft", type=Path, help="draft checkpoint (else --draft-shapes)")
    ap.add_argument("--draft-shapes", default="qwen35-0.5b,attn-0.5b")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--keep", default="0.2,0.3")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per point (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2048, help="prompt tokens of one untimed dense + sparse run per draft")
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-s", type=float, default=1e9, help="wall seconds for the whole run; units that do not fit are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny random shapes and short prompts (a logic check on CPU)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    if a.smoke:
        a.model = a.draft = None
        a.target_shape, a.draft_shapes = "small", "small-draft,small-attn"
        a.lengths = "256,512" if a.lengths == ap.get_default("lengths") else a.lengths
        a.warmup = 128 if a.warmup == ap.get_default("warmup") else a.warmup

    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    dtype = getattr(mx, a.dtype)
    tokenizer = load_tokenizer(a.model or TRAINED)
    model, target_params = checkpoint_target(a.model, dtype) if a.model else random_model(a.target_shape, dtype)
    drafts = {}
    if a.draft:
        drafts[a.draft.name] = checkpoint_draft(a.draft, dtype)
    else:
        for s in a.draft_shapes.split(","):
            drafts[s] = random_model(s, dtype)
    lengths = [int(x) for x in a.lengths.split(",")]
    keeps = [float(x) for x in a.keep.split(",")]
    bench = Bench(model, tokenizer, a.prefill_step_size)
    kind = "gpu" if mx.default_device() == mx.gpu else "cpu"
    out = a.out or REPO / "benchmarks" / "results" / f"specprefill_speed-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "versions": versions(), "args": {k: str(v) for k, v in vars(a).items()},
        "target": {"name": str(a.model or a.target_shape), "params": int(target_params)},
        "drafts": {k: {"params": int(v[1])} for k, v in drafts.items()},
        "build_s": round(time.perf_counter() - t_start, 1), "points": [], "skipped": [],
    }

    def save() -> None:
        report["wall_s"] = round(time.perf_counter() - t_start, 1)
        out.write_text(json.dumps(report, indent=2) + "\n")

    if a.warmup:
        w = prompt_ids(tokenizer, a.warmup, a.model is not None, seed=1)
        bench.dense(w)
        for name, (draft, _) in drafts.items():
            bench.sparse(draft, w, keeps[0])
        report["warmup_s"] = round(time.perf_counter() - t_start - report["build_s"], 1)
    save()

    dense_per_tok: float | None = None  # seconds per prompt token, the longest length measured so far
    unit_share: dict[str, float] = {}  # a draft unit's time over its length's dense TTFT
    left = lambda: a.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    for n in lengths:
        est_dense = (dense_per_tok * n * 1.15 if dense_per_tok else 0.0) * a.repeats
        if dense_per_tok is not None and est_dense > left():  # the first length has no estimate: it runs
            report["skipped"].append({"tokens": n, "what": "all", "why": f"dense alone ~{est_dense:.0f} s > {left():.0f} s left"})
            save()
            continue
        prompt = prompt_ids(tokenizer, n, a.model is not None, seed=n)
        dense = statistics.median(bench.dense(prompt) for _ in range(a.repeats))
        dense_per_tok = dense / n
        for name, (draft, _) in drafts.items():
            est = dense * unit_share.get(name, 0.5 * len(keeps)) * a.repeats
            if est > left():
                report["skipped"].append({"tokens": n, "what": name, "why": f"~{est:.0f} s > {left():.0f} s left"})
                save()
                continue
            tic = time.perf_counter()
            for keep in keeps:
                runs = [bench.sparse(draft, prompt, keep) for _ in range(a.repeats)]
                ttft = statistics.median(r["ttft_s"] for r in runs)
                draft_s = statistics.median(r["scoring_s"] for r in runs)
                ideal = 1.0 / (keep + draft_s / dense)
                p = {"tokens": n, "draft": name, "keep": keep, "kept": runs[0]["kept"], "dense_ttft_s": round(dense, 4),
                     "sparse_ttft_s": round(ttft, 4), "draft_scoring_s": round(draft_s, 4),
                     "sparse_prefill_s": round(ttft - draft_s, 4), "draft_cost_over_target": round(draft_s / dense, 4),
                     "speedup": round(dense / ttft, 3), "ideal": round(ideal, 3),
                     "efficiency": round(dense / ttft / ideal, 3)}
                report["points"].append(p)
                print(json.dumps(p), flush=True)
                save()
            unit_share[name] = (time.perf_counter() - tic) / (dense * a.repeats)
    save()
    print(json.dumps({"points": len(report["points"]), "skipped": report["skipped"], "wall_s": report["wall_s"],
                      "out": str(out)}))


if __name__ == "__main__":
    main()
