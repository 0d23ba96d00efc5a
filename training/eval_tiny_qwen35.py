#!/usr/bin/env python3
"""Evaluate a trained tiny Qwen3.5 checkpoint the way the server runs it (MLX, any device).

Loads the checkpoint with mlx_vlm.load, builds the text model with vllm_mlx's
text_model_from_vlm.build_text_model, injects the MTP head with vllm_mlx's inject_mtp_support, and
measures on held-out stdlib files (the split rule of train_tiny_qwen35.py):
  perplexity          teacher-forced, mlx-lm's own gated-delta recurrence (what serving runs)
  agreement           teacher-forced: argmax of the MTP head at t == backbone argmax at t+1
  greedy acceptance   greedy decoding from held-out prompts, one MTP draft per step: the draft for
                      token t+2 (from hidden_t and the greedy token t+1) equals the backbone's
                      greedy token t+2. "prefilled": the MTP cache first runs over the prompt (as
                      mlx-vlm's drafter does); "cold": it starts empty at the first generated token.

  python training/eval_tiny_qwen35.py models/tiny-qwen35-trained --train-log RUN/train_log.json \
      --out benchmarks/results/trained_model.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_qwen35 import is_heldout, stdlib_files


def heldout_tokens(model_dir: Path, stdlib: Path, limit: int | None = None) -> np.ndarray:
    """The held-out files' tokens, each file ended by <|endoftext|>; with ``limit``, only the first ``limit``
    (the files after them are not read: all of them are ~345K tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    sep = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for f in stdlib_files(stdlib):
        if limit is not None and len(ids) >= limit:
            break
        if is_heldout(str(f.relative_to(stdlib))):
            ids.extend(tok.encode(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False).ids)
            ids.append(sep)
    return np.asarray(ids[:limit], dtype=np.int32)


def load_served(model_dir: Path):
    from mlx_vlm import load
    from vllm_mlx.patches.qwen3_5_mtp import inject_mtp_support, validate_mtp_support
    from vllm_mlx.text_model_from_vlm import build_text_model

    vlm, _ = load(str(model_dir))
    tm = build_text_model(vlm, str(model_dir))
    cfg = json.loads((model_dir / "config.json").read_text())
    if not (inject_mtp_support(tm, str(model_dir), cfg) and validate_mtp_support(tm)):
        raise SystemExit("inject_mtp_support failed on the checkpoint")
    return vlm, tm


def teacher_forced(tm, tokens: np.ndarray, seq: int, windows: int, batch: int) -> dict:
    import mlx.core as mx
    import mlx.nn as nn

    n = min(windows, (tokens.size - 1) // (seq + 1))
    rows = np.stack([tokens[i * (seq + 1) : (i + 1) * (seq + 1)] for i in range(n)])
    ce_sum, agree_sum, agree_n, tok_n = 0.0, 0.0, 0, 0
    for i in range(0, n, batch):
        x = mx.array(rows[i : i + batch])
        logits, hidden = tm(x[:, :-1], return_hidden=True)
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), x[:, 1:], reduction="sum")
        m_logits = tm.mtp_forward(hidden[:, :-1], x[:, 1:-1], mtp_cache=tm.make_mtp_cache())
        agree = (mx.argmax(m_logits, -1) == mx.argmax(logits[:, 1:], -1)).sum()
        mx.eval(ce, agree)
        ce_sum += ce.item()
        agree_sum += agree.item()
        agree_n += x.shape[0] * (seq - 1)
        tok_n += x.shape[0] * seq
    return {"tokens": tok_n, "ce": ce_sum / tok_n, "ppl": math.exp(ce_sum / tok_n),
            "mtp_agreement": agree_sum / agree_n}


def greedy_acceptance(tm, tokens: np.ndarray, prompts: int, prompt_len: int, gen: int, prefill_mtp: bool) -> dict:
    import mlx.core as mx

    stride = max(prompt_len + gen, tokens.size // max(1, prompts))
    drafts = accepted = 0
    for p in range(prompts):
        prompt = mx.array(tokens[p * stride : p * stride + prompt_len])[None]
        cache, mcache = tm.make_cache(), tm.make_mtp_cache()
        logits, hidden = tm(prompt, cache=cache, return_hidden=True)
        nxt = mx.argmax(logits[:, -1:], -1)
        if prefill_mtp and prompt_len > 1:  # (h_t, tok_{t+1}) for t < P-1, as mlx-vlm's drafter prefills
            tm.mtp_forward(hidden[:, :-1], prompt[:, 1:], mtp_cache=mcache)
        h_last = hidden[:, -1:]
        for _ in range(gen):
            draft = mx.argmax(tm.mtp_forward(h_last, nxt, mtp_cache=mcache), -1)
            logits, hidden = tm(nxt, cache=cache, return_hidden=True)
            nxt = mx.argmax(logits[:, -1:], -1)
            h_last = hidden
            mx.eval(draft, nxt)
            drafts += 1
            accepted += int(draft.item() == nxt.item())
    return {"prompts": prompts, "prompt_tokens": prompt_len, "generated_per_prompt": gen,
            "drafts": drafts, "accepted": accepted, "acceptance": accepted / max(1, drafts)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--train-log", type=Path, default=None)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    import mlx.core as mx

    t0 = time.perf_counter()
    tokens = heldout_tokens(a.model, a.stdlib)
    vlm, tm = load_served(a.model)
    tf = teacher_forced(tm, tokens, a.seq, a.windows, a.batch)
    print(json.dumps({"teacher_forced": tf}), flush=True)
    warm = greedy_acceptance(tm, tokens, a.prompts, a.prompt_len, a.gen, prefill_mtp=True)
    cold = greedy_acceptance(tm, tokens, a.prompts, a.prompt_len, a.gen, prefill_mtp=False)
    print(json.dumps({"prefilled": warm, "cold": cold}), flush=True)

    files = [f for f in a.model.rglob("*") if f.is_file()]
    result = {
        "model": str(a.model),
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "config": json.loads((a.model / "config.json").read_text())["text_config"],
        "eval_device": f"MLX {mx.__version__} {mx.default_device()}; {platform.machine()} Python {platform.python_version()}",
        "eval_loader": "mlx_vlm.load + vllm_mlx build_text_model + inject_mtp_support (bf16 as served)",
        "heldout": {"rule": "non-test stdlib files with sha1(relative path) % 10 == 0",
                    "stdlib": str(a.stdlib), "tokens": int(tokens.size)},
        "perplexity": tf["ppl"],
        "teacher_forced": tf,
        "acceptance": {"greedy_decode": warm["acceptance"], "greedy_decode_cold_mtp_cache": cold["acceptance"],
                       "teacher_forced_agreement": tf["mtp_agreement"], "prefilled": warm, "cold": cold},
        "eval_seconds": time.perf_counter() - t0,
    }
    if a.train_log and a.train_log.exists():
        log = json.loads(a.train_log.read_text())
        result["training"] = {k: log[k] for k in ("device", "mlx", "params", "steps", "batch", "seq", "tokens_seen",
                                                  "train_tokens", "train_seconds", "first_step_seconds",
                                                  "ms_per_step", "args", "eval")}
        result["training"]["loss_curve"] = [{k: r[k] for k in ("step", "main_ce", "mtp_ce", "mtp_agree", "s")}
                                            for r in log["log"]]
    elif a.out and a.out.exists():  # keep the training record of an earlier evaluation
        earlier = json.loads(a.out.read_text())
        if "training" in earlier:
            result["training"] = earlier["training"]
    text = json.dumps(result, indent=2)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(json.dumps({"perplexity": result["perplexity"], "acceptance": {k: v for k, v in result["acceptance"].items()
                                                                        if not isinstance(v, dict)}}))


if __name__ == "__main__":
    main()
