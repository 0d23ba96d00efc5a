#!/usr/bin/env python3
"""SpecPrefill quality on a model that uses long context: retrieval from far back, continuation perplexity,
agreement with dense.

The pair comes from training/train_long_context.py (RUN/target, RUN/draft: Qwen3.5-shaped, trained on 4K-token
windows of code with the retrieval task of training/retrieval_task.py mixed in). Two prompt sets, built from the
held-out part of its corpus.npz with a fixed seed:
  retrieval  --length-token prompts of code holding a definition ``# set K V1 V2`` about --distance tokens
             (1K-4K) before the end, --distractors other definitions, and ending with the query ``# get K``:
             accuracy = the next two tokens (greedy) are V1 V2; also the first token alone, the answer's NLL,
             and whether the kept tokens hold the definition. --pairs train: keys and values from the training
             pools, paired afresh at random (training pairs are random per window, so no pair can be recalled
             from training); --pairs heldout: from the task's held-out word tokens, never in a training definition
             (does the copy carry over to tokens the task never trained on).
  text       --length-token windows of held-out code: perplexity of the true next --cont tokens (teacher-forced
             after the prompt), top-1 agreement with dense along them, and --gen greedy tokens against dense's.
Prefill modes (each the server's ``SparsePrefill`` on the target, kept tokens at their own positions; decode
continues at the prompt's length, as in the text engine):
  dense        every prompt token;
  keep K       the draft's scores (``ScoringJob``, the server's settings: 32-token chunks, 8 look-ahead tokens);
  recent K     the last K of the prompt only (what a draft that knows nothing would keep);
  spans K      the draft's scores over 256-token chunks (whole spans for the recurrent layers);
  ends K       the first 128 and last 256 tokens dense (a system prompt and the last turn), the draft's pick
               of 32-token chunks between them, K in all;
  self K       the target scoring its own prompt (a reference: the best a draft could do by this rule).

  python benchmarks/specprefill_retrieval.py --run RUN --data DATA [--prompts 48] [--text-prompts 24]

Writes --out (default benchmarks/results/specprefill_retrieval-<device>.json) after every prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "training"))


def lm_logits(model, h):
    head = getattr(model, "lm_head", None)
    return head(h) if head is not None else model.model.embed_tokens.as_linear(h)


def prefill(model, prompt: list[int], kept: list[int]):
    from vllm_mlx_mtp_routing.specprefill.sparse_prefill import SparsePrefill
    from vllm_mlx_mtp_routing.text_engine.state import PrefillState

    state = PrefillState()
    job = SparsePrefill(model, prompt, kept, state, chunk_tokens=2048)
    while not job.done:
        job.advance()
    return state


def forward_from(model, state, tokens: list[int], start: int):
    """Logits [L, V] (float32) of ``tokens`` fed at positions start.. on the state's caches (appended)."""
    import mlx.core as mx

    from vllm_mlx_mtp_routing.specprefill.sparse_prefill import positioned_forward

    h = positioned_forward(model, mx.array([tokens], dtype=mx.uint32), mx.arange(start, start + len(tokens), dtype=mx.int32),
                           state.backbone)
    out = lm_logits(model, h)[0].astype(mx.float32)
    mx.eval(out)
    return out


def scores_of(scorer, prompt: list[int]) -> np.ndarray:
    """The scorer's per-position importance of prompt[:n-1] (the server's settings)."""
    from vllm_mlx_mtp_routing.specprefill.scoring import ScoringJob
    from vllm_mlx_mtp_routing.specprefill.settings import SpecPrefillSettings

    job = ScoringJob(scorer, prompt, 0, 0.2, 0.0, SpecPrefillSettings(), 2048)
    while not job.done:
        job.advance()
    assert job.scores is not None
    return job.scores


def kept_for(mode: str, n: int, draft_scores: np.ndarray, self_scores: np.ndarray | None) -> list[int]:
    from vllm_mlx_mtp_routing.specprefill.scoring import select_chunks

    m = n - 1  # positions the prefill covers; the last prompt token is the first decode step's input
    if mode == "dense":
        return list(range(m))
    how, k = mode.split()
    keep = float(k)
    if how == "recent":
        return list(range(m - math.ceil(m * keep), m))
    if how == "keep":
        return select_chunks(draft_scores, 0, keep, 0.0, 32)
    if how == "self":
        assert self_scores is not None
        return select_chunks(self_scores, 0, keep, 0.0, 32)
    if how == "spans":
        return select_chunks(draft_scores, 0, keep, 0.0, 256)
    if how == "ends":
        head, tail = 128, 256
        mid = m - head - tail
        want = math.ceil(m * keep) - head - tail
        if mid <= 0 or want <= 0:
            return list(range(m))
        middle = select_chunks(draft_scores[head : head + mid], head, min(1.0, want / mid), 0.0, 32)
        return sorted(set(range(head)) | set(middle) | set(range(m - tail, m)))
    raise ValueError(mode)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="train_long_context.py's output (target/, draft/)")
    ap.add_argument("--data", type=Path, required=True, help="the corpus.npz folder (its held-out part is used)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--distance", default="1000,3800", help="the queried definition's distance range, tokens")
    ap.add_argument("--distractors", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=48, help="retrieval prompts")
    ap.add_argument("--text-prompts", type=int, default=24)
    ap.add_argument("--cont", type=int, default=64, help="continuation tokens scored on text prompts")
    ap.add_argument("--gen", type=int, default=16, help="greedy tokens compared with dense on text prompts (0: none)")
    ap.add_argument("--pairs", choices=("train", "heldout"), default="train",
                    help="retrieval keys and values: the training pools paired afresh, or held-out word tokens")
    ap.add_argument("--keep", default="0.2,0.3,0.5")
    ap.add_argument("--variants", default="0.2", help="keeps of the spans / ends / self modes ('' for none)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop adding prompts past this many seconds")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()

    import mlx.core as mx

    from retrieval_task import load_task, retrieval_prompt
    from train_long_context import load_model

    from vllm_mlx_mtp_routing.model.kernels.swaps import use_fused_recurrence

    target, draft = load_model(a.run / "target", a.dtype), load_model(a.run / "draft", a.dtype)
    use_fused_recurrence(target)  # as the server's text model (a no-op off CUDA); the draft gets it in ScoringJob
    task = load_task(a.run / "tokenizer.json", a.pairs)
    heldout = np.load(a.data / "corpus.npz")["heldout"].astype(np.int32)
    keeps = [float(k) for k in a.keep.split(",") if k]
    var = [float(k) for k in a.variants.split(",") if k]
    modes = (["dense"] + [f"keep {k}" for k in keeps] + [f"recent {k}" for k in keeps] + [f"spans {k}" for k in var]
             + [f"ends {k}" for k in var] + [f"self {k}" for k in var])
    kind = "gpu" if mx.default_device() == mx.gpu else "cpu"
    out = a.out or REPO / "benchmarks" / "results" / f"specprefill_retrieval-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    lo, hi = (int(x) for x in a.distance.split(","))
    ret_rows: list[dict] = []
    text_rows: list[dict] = []

    def select_all(prompt: list[int]) -> dict[str, list[int]]:
        ds = scores_of(draft, prompt)
        ss = scores_of(target, prompt) if var else None
        return {mode: kept_for(mode, len(prompt), ds, ss) for mode in modes}

    def summary() -> dict:
        s: dict[str, dict] = {}
        for mode in modes:
            r = {}
            if ret_rows:
                ms = [row["modes"][mode] for row in ret_rows]
                r.update(retrieval_acc=round(float(np.mean([m["exact"] for m in ms])), 3),
                         first_token_acc=round(float(np.mean([m["first"] for m in ms])), 3),
                         answer_nll=round(float(np.mean([m["nll"] for m in ms])), 3),
                         definition_kept=round(float(np.mean([m["def_kept"] for m in ms])), 3),
                         kept_share=round(float(np.mean([m["kept_share"] for m in ms])), 3))
                for b0 in range(1000, 4000, 1000):
                    sel = [m["exact"] for m, row in zip(ms, ret_rows) if b0 <= row["distance"] < b0 + 1000]
                    if sel:
                        r[f"retrieval_acc_{b0 // 1000}k-{b0 // 1000 + 1}k"] = round(float(np.mean(sel)), 3)
            if text_rows:
                ms = [row["modes"][mode] for row in text_rows]
                ppl = math.exp(sum(m["nll_sum"] for m in ms) / sum(m["n"] for m in ms))
                r.update(text_ppl=round(ppl, 3), top1_agree_with_dense=round(float(np.mean([m["top1_agree"] for m in ms])), 3))
                if a.gen:
                    r.update(greedy_agree_with_dense=round(float(np.mean([m["greedy_agree"] for m in ms])), 3),
                             greedy_identical=round(float(np.mean([m["greedy_identical"] for m in ms])), 3))
            s[mode] = r
        if text_rows and "dense" in s:
            for mode in modes:
                s[mode]["text_ppl_over_dense"] = round(s[mode]["text_ppl"] / s["dense"]["text_ppl"], 3)
        return s

    def save() -> dict:
        sm = summary()
        out.write_text(json.dumps({
            "device": str(mx.default_device()), "mlx": mx.__version__, "commit": os.environ.get("BENCH_COMMIT", ""),
            "args": {k: str(v) for k, v in vars(a).items()}, "pairs": a.pairs, "chance_exact": 1.0 / len(task.values) ** 2,
            "chance_first": 1.0 / len(task.values), "retrieval_prompts": len(ret_rows), "text_prompts": len(text_rows),
            "seconds": round(time.perf_counter() - t0, 1), "summary": sm, "retrieval_rows": ret_rows, "text_rows": text_rows,
        }, indent=1) + "\n")
        return sm

    left = lambda: a.budget_s - (time.perf_counter() - t0)  # noqa: E731
    per_prompt = 0.0
    # Interleaved in proportion, so a cut budget leaves both sets measured.
    total = a.prompts + a.text_prompts
    order: list[str] = []
    r = t = 0
    for i in range(total):
        if t >= a.text_prompts or (r < a.prompts and r * total <= i * a.prompts):
            order.append("r")
            r += 1
        else:
            order.append("t")
            t += 1
    for kind_i in order:
        if per_prompt and left() < 1.5 * per_prompt:
            print(f"budget: stopping after {len(ret_rows)} retrieval and {len(text_rows)} text prompts", flush=True)
            break
        tic = time.perf_counter()
        if kind_i == "r":
            p = retrieval_prompt(task, heldout, rng, a.length, int(rng.integers(lo, hi + 1)), a.distractors)
            n = len(p.ids)
            row = {"distance": p.distance, "tokens": n, "modes": {}}
            for mode, kept in select_all(p.ids).items():
                logits = forward_from(target, prefill(target, p.ids, kept), [p.ids[-1], p.answer[0]], n - 1)
                lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                top = mx.argmax(logits, axis=-1).tolist()
                ks = set(kept)
                row["modes"][mode] = {
                    "first": int(top[0] == p.answer[0]), "exact": int(top == p.answer),
                    "nll": -float(lp[0, p.answer[0]].item() + lp[1, p.answer[1]].item()) / 2,
                    "def_kept": int(all(j in ks for j in range(*p.def_span))), "kept_share": len(kept) / (n - 1)}
            ret_rows.append(row)
            print(json.dumps({"retrieval": len(ret_rows), "distance": p.distance,
                              **{m: v["exact"] for m, v in row["modes"].items()}}), flush=True)
        else:
            start = int(rng.integers(0, heldout.size - a.length - a.cont))
            window = heldout[start : start + a.length + a.cont].tolist()
            prompt, cont = window[: a.length], window[a.length :]
            n = len(prompt)
            row = {"tokens": n, "modes": {}}
            dense_top: list[int] = []
            dense_gen: list[int] = []
            for mode, kept in select_all(prompt).items():
                logits = forward_from(target, prefill(target, prompt, kept), [prompt[-1], *cont[:-1]], n - 1)
                lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                nll = -float(mx.take_along_axis(lp, mx.array(cont)[:, None], axis=-1).sum().item())
                top = mx.argmax(logits, axis=-1).tolist()
                m = {"nll_sum": nll, "n": len(cont), "kept_share": len(kept) / (n - 1)}
                if mode == "dense":
                    dense_top = top
                m["top1_agree"] = float(np.mean([x == y for x, y in zip(top, dense_top)]))
                if a.gen:
                    state, gen, tok = prefill(target, prompt, kept), [], prompt[-1]
                    for j in range(a.gen):
                        tok = int(mx.argmax(forward_from(target, state, [tok], n - 1 + j)[-1]).item())
                        gen.append(tok)
                    if mode == "dense":
                        dense_gen = gen
                    m["greedy_agree"] = float(np.mean([x == y for x, y in zip(gen, dense_gen)]))
                    m["greedy_identical"] = int(gen == dense_gen)
                row["modes"][mode] = m
            text_rows.append(row)
            print(json.dumps({"text": len(text_rows), **{mo: round(math.exp(v["nll_sum"] / v["n"]), 2)
                                                         for mo, v in row["modes"].items()}}), flush=True)
        per_prompt = max(per_prompt, time.perf_counter() - tic)
        save()
    sm = save()
    print(json.dumps(sm), flush=True)
    table = markdown(sm, a.gen)
    out.with_suffix(".md").write_text(table)
    print(table, flush=True)


NAMES = {"dense": "dense", "keep": "SpecPrefill, keep {k}", "recent": "the most recent {p}%", "spans": "keep {k} in 256-token spans",
         "ends": "keep {k}, first 128 + last 256 dense", "self": "the target scoring itself, keep {k}"}


def markdown(summary: dict, gen: int) -> str:
    """The docs table (docs/benchmarks.md, SpecPrefill quality on the long-context pair)."""
    head = ["prefill", "kept", "retrieval acc.", "1st answer token", "definition kept", "continuation ppl / dense",
            "top-1 = dense"] + ([f"{gen} greedy = dense"] if gen else [])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for mode, r in summary.items():
        how, _, k = mode.partition(" ")
        name = NAMES[how].format(k=k, p=round(100 * float(k)) if k else "")
        cells = [name, f"{r.get('kept_share', 1.0):.2f}", f"{r.get('retrieval_acc', float('nan')):.2f}",
                 f"{r.get('first_token_acc', float('nan')):.2f}", f"{r.get('definition_kept', float('nan')):.2f}",
                 f"{r.get('text_ppl_over_dense', float('nan')):.3f}", f"{r.get('top1_agree_with_dense', float('nan')):.2f}"]
        if gen:
            cells.append(f"{r.get('greedy_identical', float('nan')):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
