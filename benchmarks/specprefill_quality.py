#!/usr/bin/env python3
"""SpecPrefill quality on long-context code: does the sparse prefill keep what the continuation needs?

Prompts come from the trained model's held-out standard-library files (training/train_tiny_qwen35.py's
rule). Each is a file cut right before a call to a function the same file defined at least
--min-distance tokens earlier, where the function's name does not occur in the last --recent tokens
before the cut: naming the callee needs the early context. A prompt is at least --min-prompt tokens
and at most --max-prompt (the file's last tokens before the cut; the definition stays inside).

Every prompt is decoded greedily for --gen tokens on the text engine (``BatchScheduler``, no MTP):
  dense        the whole prompt prefilled;
  keep K       ``specprefill.prefill_sparse``: the draft scores the prompt, the kept chunks are prefilled
               at their own positions (the code the server runs);
  recent K     the same sparse prefill of the last K of the prompt only (a baseline: what a draft that
               knows nothing would keep).
Reported per mode: agreement of the first --gen tokens with dense (share of equal positions, and the
common prefix), task accuracy (the continuation names the callee: ``name(``; and reproduces the call
through the end of its first line), and how often the kept tokens include the callee's ``def`` line.

  python benchmarks/specprefill_quality.py [--model M] [--draft D] [--keep 0.2,0.3,0.5] [--prompts 40]

Writes benchmarks/results/specprefill_quality-<device>.json (or --out); prints the summary last.
The committed tiny model barely uses its long context; specprefill_retrieval.py measures on a pair trained to.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import difflib
import json
import math
import os
import re
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "training"))


@dataclass
class CallSite:
    file: str
    name: str
    lead: str  # text of the cut token before the callee's name (".", " ", or nothing: BPE merges them)
    call_line: str  # the call from the callee's name to the end of its first line
    prompt_ids: list[int]
    def_span: tuple[int, int]  # prompt token range of the callee's `def name(` line
    distance: int  # tokens from the definition to the cut


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def file_call_sites(text: str, rel: str, tokenizer, *, min_distance: int, recent: int, min_prompt: int,
                    max_prompt: int) -> list[CallSite]:
    """The file's qualifying call sites, first call of each function only, in file order."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    starts = _line_starts(text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], [o[0] for o in enc["offset_mapping"]]
    defs: dict[str, tuple[int, int]] = {}  # name -> (char offset of `def`, char offset of its line's end)
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("__") and n.name not in defs:
            at = starts[n.lineno - 1] + n.col_offset
            defs[n.name] = (at, starts[n.lineno])
    calls = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            fn = n.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            if name in defs:
                at = starts[fn.end_lineno - 1] + fn.end_col_offset - len(name)
                calls.append((at, name, n))
    out, seen = [], set()
    for at, name, node in sorted(calls, key=lambda c: c[0]):
        if name in seen:
            continue
        cut = bisect.bisect_right(offs, at) - 1  # the token holding the name's first character
        d0 = bisect.bisect_right(offs, defs[name][0]) - 1
        d1 = bisect.bisect_left(offs, defs[name][1])
        first = max(0, cut - max_prompt)
        if cut - first < min_prompt or cut - d0 < min_distance or d0 < first:
            continue
        if re.search(r"\b%s\b" % re.escape(name), text[offs[max(0, cut - recent)] : offs[cut]]):
            continue
        seen.add(name)
        end = starts[node.lineno] if node.end_lineno > node.lineno else starts[node.end_lineno - 1] + node.end_col_offset
        out.append(CallSite(rel, name, text[offs[cut] : at], text[at:end].rstrip("\n"), ids[first:cut],
                            (d0 - first, d1 - first), cut - d0))
    return out


def call_sites(tokenizer, n: int, per_file: int, **limits) -> list[CallSite]:
    """Up to ``n`` sites from the held-out files, at most ``per_file`` from one file (spread over it)."""
    from train_tiny_qwen35 import is_heldout, stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    by_file = []
    for f in stdlib_files(root):
        rel = str(f.relative_to(root))
        if is_heldout(rel):
            sites = file_call_sites(f.read_text(encoding="utf-8", errors="replace"), rel, tokenizer, **limits)
            if len(sites) > per_file:
                sites = [sites[round(i * (len(sites) - 1) / (per_file - 1))] for i in range(per_file)] if per_file > 1 else sites[:1]
            by_file.append(sites)
    out = []
    for i in range(per_file):  # round-robin over files
        out += [s[i] for s in by_file if i < len(s)]
    return out[:n]


def task_scores(site: CallSite, text: str) -> dict:
    """The continuation names the callee (``name(``), and reproduces the call's first line."""
    t = text.lstrip(" \t")
    lead = site.lead.lstrip(" \t")
    return {"name": t.startswith(lead + site.name + "("), "call": t.startswith(lead + site.call_line)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--draft", type=Path, default=REPO / "models" / "tiny-qwen35-draft")
    ap.add_argument("--keep", default="0.2,0.3,0.5")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--per-file", type=int, default=1)
    ap.add_argument("--min-distance", type=int, default=1000, help="tokens from the callee's def to the cut")
    ap.add_argument("--recent", type=int, default=1024, help="the callee's name is absent from this many tokens before the cut")
    ap.add_argument("--min-prompt", type=int, default=1536)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--dtype", default="float32", help="weights cast to this dtype (float32: exact comparisons)")
    ap.add_argument("--baseline-keep", default="0.2", help="keeps of the recent-K baseline ('' for none)")
    ap.add_argument("--self-keep", default="0.2", help="keeps scored by the target itself as its own draft ('' for none)")
    ap.add_argument("--sites", default="", help="a slice I:J of the sites (to run shards in parallel)")
    ap.add_argument("--merge", type=Path, nargs="*", help="combine shard results (same arguments otherwise) into --out")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm import load as lm_load
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.specprefill import PrefillState, prefill_sparse
    from vllm_mlx_mtp_routing.specprefill.sparse_prefill import SparsePrefill
    from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
    from vllm_mlx_mtp_routing.text_engine.state import TextRequest
    from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    t0 = time.perf_counter()
    vlm, processor = load(str(args.model))
    model = build_text_model(vlm, args.model, json.loads((args.model / "config.json").read_text()), enable_mtp=False).model
    tok = processor.tokenizer
    draft = lm_load(str(args.draft))[0]
    dtype = getattr(mx, args.dtype)
    model.set_dtype(dtype)
    draft.set_dtype(dtype)
    sites = call_sites(tok, args.prompts, args.per_file, min_distance=args.min_distance, recent=args.recent,
                       min_prompt=args.min_prompt, max_prompt=args.max_prompt)
    if not sites:
        raise SystemExit("no call site qualifies; loosen --min-distance / --recent / --min-prompt")
    keeps = [float(k) for k in args.keep.split(",")]
    opts = SamplingOptions(max_tokens=args.gen)

    def decode(prompt: list[int], state: PrefillState | None = None) -> list[int]:
        sched = BatchScheduler(model, tok, prefill_step_size=2048)
        sched.add(TextRequest("q", prompt, opts), restored=state)
        while sched.has_work():
            for o in sched.step():
                if o.finished:
                    return o.token_ids
        raise RuntimeError("the request did not finish")

    def recent_state(prompt: list[int], keep: float) -> tuple[PrefillState, list[int]]:
        n = len(prompt) - 1
        kept = list(range(n - math.ceil(n * keep), n))
        state = PrefillState()
        job = SparsePrefill(model, prompt, kept, state, chunk_tokens=2048)
        while not job.done:
            job.advance()
        return state, kept

    base = [float(k) for k in args.baseline_keep.split(",") if k]
    selfk = [float(k) for k in args.self_keep.split(",") if k]
    modes = ["dense"] + [f"keep {k}" for k in keeps] + [f"recent {k}" for k in base] + [f"self {k}" for k in selfk]
    kind = "gpu" if mx.default_device() == mx.gpu else "cpu"
    out = args.out or REPO / "benchmarks" / "results" / f"specprefill_quality-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if args.sites:
        i, j = (int(x) if x else None for x in args.sites.split(":"))
        sites = sites[i:j]

    def summarize() -> dict:
        summary = {}
        for mode in modes:
            ms = [r["modes"][mode] for r in rows]
            s = {"name_acc": round(sum(m["name"] for m in ms) / len(ms), 3),
                 "call_acc": round(sum(m["call"] for m in ms) / len(ms), 3),
                 "agree_first%d" % args.gen: round(sum(m["agree"] for m in ms) / len(ms), 3),
                 "identical_first%d" % args.gen: round(sum(m["prefix"] == args.gen for m in ms) / len(ms), 3),
                 "mean_common_prefix": round(sum(m["prefix"] for m in ms) / len(ms), 2),
                 "first_token_equal": round(sum(m["prefix"] >= 1 for m in ms) / len(ms), 3),
                 # order-aware but shift-tolerant: difflib's ratio of the decoded texts
                 "text_similarity": round(sum(difflib.SequenceMatcher(None, m["text"], r["modes"]["dense"]["text"]).ratio()
                                              for m, r in zip(ms, rows)) / len(ms), 3)}
            if "def_kept" in ms[0]:
                s["def_line_kept"] = round(sum(m["def_kept"] for m in ms) / len(ms), 3)
                s["kept_share"] = round(sum(m["kept"] for m in ms) / sum(r["prompt_tokens"] - 1 for r in rows), 3)
            summary[mode] = s
        return summary

    def save() -> dict:
        summary = summarize()
        results = {
            "device": str(mx.default_device()), "mlx": mx.__version__, "python": sys.version.split()[0],
            "commit": os.environ.get("BENCH_COMMIT", ""), "model": str(args.model), "draft": str(args.draft),
            "dtype": args.dtype, "args": {k: str(v) for k, v in vars(args).items()}, "sites_found": len(sites),
            "prompts": len(rows), "files": len({r["file"] for r in rows}),
            "prompt_tokens_mean": round(sum(r["prompt_tokens"] for r in rows) / len(rows)),
            "distance_mean": round(sum(r["distance"] for r in rows) / len(rows)),
            "seconds": round(time.perf_counter() - t0, 1), "summary": summary, "rows": rows,
        }
        out.write_text(json.dumps(results, indent=2) + "\n")
        return summary

    if args.merge:
        by_key = {(s.file, s.name): s for s in sites}
        for f in args.merge:
            rows += json.loads(f.read_text())["rows"]
        for r in rows:  # task scores again from the texts, by this version's rule
            r["lead"] = by_key[(r["file"], r["name"])].lead
            for m in r["modes"].values():
                m.update(task_scores(by_key[(r["file"], r["name"])], m["text"]))
        print(json.dumps(save()))
        return
    for i, site in enumerate(sites):
        p = site.prompt_ids
        dense = decode(p)
        row = {**{k: v for k, v in asdict(site).items() if k != "prompt_ids"}, "prompt_tokens": len(p), "modes": {}}
        for mode in modes:
            kept = None
            if mode == "dense":
                ids = dense
            else:
                how, k = mode.split()
                if how == "recent":
                    state, kept = recent_state(p, float(k))
                else:
                    state, kept = prefill_sparse(model, draft if how == "keep" else model, p, float(k))
                ids = decode(p, state)
            n = min(args.gen, len(ids), len(dense))
            prefix = next((j for j in range(n) if ids[j] != dense[j]), n)
            m = {"agree": sum(a == b for a, b in zip(ids[:n], dense[:n])) / max(n, 1), "prefix": prefix,
                 **task_scores(site, tok.decode(ids)), "text": tok.decode(ids)}
            if kept is not None:
                ks = set(kept)
                m["kept"] = len(kept)
                m["def_kept"] = any(j in ks for j in range(*site.def_span))
            row["modes"][mode] = m
        rows.append(row)
        print(json.dumps({"i": i, "file": site.file, "name": site.name, "tokens": len(p),
                          **{mo: (int(v["name"]), int(v["call"]), round(v["agree"], 2)) for mo, v in row["modes"].items()}}),
              flush=True)
        save()

    print(json.dumps(save()))


if __name__ == "__main__":
    main()
