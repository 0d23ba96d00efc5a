#!/usr/bin/env python3
"""MTP after a sparse prefill: acceptance of the MTP head's drafts when decoding continues from a
SpecPrefill state, against the same prompts prefilled densely (and how often the greedy output agrees).

In process, on the text engine (``BatchScheduler`` with ``MTPDecode``, k drafts every step,
greedy): prompts of --prompt-tokens tokens cut from held-out standard-library files (the trained
model's held-out rule, training/train_tiny_qwen35.py), each prefilled densely and with SpecPrefill
at every --keep value (the draft scores the whole prompt; ``specprefill.prefill_sparse`` is the same
code the server runs), then --gen-tokens decoded. Reported per mode: drafted, accepted, acceptance,
and the share of the first 32 generated tokens equal to dense.

  python benchmarks/specprefill_mtp.py [--model M] [--draft D] [--prompt-tokens 2048] [--prompts 4]

Writes benchmarks/results/specprefill_mtp-<device>.json (or --out) and prints a JSON summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "training"))


def heldout_prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    from train_tiny_qwen35 import is_heldout, stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in stdlib_files(root) if is_heldout(str(f.relative_to(root)))]
    prompts, i = [], 0
    while len(prompts) < n and i < len(files):
        ids: list[int] = []
        while len(ids) < tokens and i < len(files):
            ids += tokenizer.encode(files[i].read_text(errors="replace"), add_special_tokens=False)
            i += 1
        if len(ids) >= tokens:
            prompts.append(ids[:tokens])
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--draft", type=Path, help="omitted: a random 2-layer draft with the model's tokenizer")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--keep", default="0.2,0.3,0.5")
    ap.add_argument("--k", type=int, default=1, help="MTP draft tokens per step")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm import load as lm_load
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.specprefill import prefill_sparse
    from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
    from vllm_mlx_mtp_routing.text_engine.state import TextRequest
    from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
    from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    vlm, processor = load(str(args.model))
    bundle = build_text_model(vlm, args.model, json.loads((args.model / "config.json").read_text()))
    tok = processor.tokenizer
    if bundle.mtp is None:
        raise SystemExit(f"{args.model} has no MTP head")
    draft_dir = args.draft
    if draft_dir is None:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from specprefill_stall import tiny_draft

        draft_dir = tiny_draft(args.model, Path(os.environ.get("TMPDIR", "/tmp")) / "specprefill_mtp_draft")
    draft = lm_load(str(draft_dir))[0]
    prompts = heldout_prompts(tok, args.prompts, args.prompt_tokens)
    opts = SamplingOptions(max_tokens=args.gen_tokens)

    def decode(prompt: list[int], state=None):
        sched = BatchScheduler(bundle.model, tok, prefill_step_size=2048, decode=MTPDecode(bundle.mtp, k=args.k, adaptive=False))
        sched.add(TextRequest("r", prompt, opts), restored=state)
        while sched.has_work():
            for out in sched.step():
                if out.finished:
                    return out

    keeps = [float(k) for k in args.keep.split(",")]
    modes: dict[str, dict] = {m: {"drafted": 0, "accepted": 0, "agree32": [], "seconds": 0.0} for m in ["dense", *map(str, keeps)]}
    for prompt in prompts:
        tic = time.perf_counter()
        dense = decode(prompt)
        modes["dense"]["seconds"] += time.perf_counter() - tic
        for m, out in [("dense", dense)]:
            modes[m]["drafted"] += out.mtp_drafted
            modes[m]["accepted"] += out.mtp_accepted
        for keep in keeps:
            tic = time.perf_counter()
            state, _ = prefill_sparse(bundle.model, draft, prompt, keep, decode=MTPDecode(bundle.mtp, k=args.k))
            out = decode(prompt, state)
            m = modes[str(keep)]
            m["seconds"] += time.perf_counter() - tic
            m["drafted"] += out.mtp_drafted
            m["accepted"] += out.mtp_accepted
            n = min(32, len(out.token_ids), len(dense.token_ids))
            m["agree32"].append(sum(a == b for a, b in zip(out.token_ids[:n], dense.token_ids[:n])) / max(n, 1))
    summary = {}
    for name, m in modes.items():
        summary[name] = {"drafted": m["drafted"], "accepted": m["accepted"],
                         "acceptance": round(m["accepted"] / m["drafted"], 3) if m["drafted"] else None}
        if m["agree32"]:
            summary[name]["agree_first32_vs_dense"] = round(sum(m["agree32"]) / len(m["agree32"]), 3)
    results = {"device": str(mx.default_device()), "mlx": mx.__version__, "model": str(args.model), "draft": str(draft_dir),
               "prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "k": args.k,
               "commit": os.environ.get("BENCH_COMMIT", ""), "summary": summary}
    kind = "gpu" if mx.default_device() == mx.gpu else "cpu"
    out = args.out or REPO / "benchmarks" / "results" / f"specprefill_mtp-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
