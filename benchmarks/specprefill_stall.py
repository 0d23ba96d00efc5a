#!/usr/bin/env python3
"""SpecPrefill stall and TTFT: running streams while one long prompt is scored and sparse-prefilled,
against the same prompt prefilled densely, on one server (same model, same --prefill-step-size).

Through the real `vllm-mlx serve --plugins mtp-routing --specprefill --specprefill-draft-model D` on
loopback (prefix cache off, so the second run of the prompt is not a cache hit). N streams decode;
the long prompt arrives (max_tokens 1) first with `specprefill: false` (dense), then with
`specprefill: true` (sparse, keep --keep-pct), each measured as benchmarks/prefill_stall.py does:
the longest gap between a stream's tokens while it prefills, /health's latency, and its TTFT.
Target (issue 17): longest gap sparse <= 2x longest gap dense.

  python benchmarks/specprefill_stall.py --draft DRAFT_DIR --prompt-tokens 4096      # CPU
  python benchmarks/specprefill_stall.py --model M --draft D --prompt-tokens 16384   # GPU

Writes benchmarks/results/specprefill_stall-<device>.json (or --out) and prints a JSON summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*
sys.path.insert(0, str(REPO / "benchmarks"))

from prefill_stall import long_prompt, measure  # noqa: E402

from support.server import serve  # noqa: E402


def tiny_draft(model: Path, out: Path) -> Path:
    """A 2-layer random draft with the model's tokenizer (scores are then noise; stall and speed are not)."""
    from support.tiny_model import build_tiny_qwen35_vlm

    if not (out / "config.json").is_file():
        build_tiny_qwen35_vlm(out, num_layers=2, full_attention_interval=2, hidden_size=128, intermediate_size=256,
                              mtp_placement="none", tokenizer_from=model, force=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--draft", type=Path, help="the SpecPrefill draft; omitted: a random 2-layer one with the model's tokenizer")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--keep-pct", type=float, default=0.2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--warm-tokens", type=int, default=8)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2, help="dense/sparse pairs (alternating; the worst gap of each kind)")
    ap.add_argument("--flags", default="", help="extra serve flags")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--command", default="", help="replaces the vllm-mlx console script (e.g. a launcher)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import mlx.core as mx

    kind = "gpu" if mx.default_device() == mx.gpu else "cpu"
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "specprefill_stall_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    draft = args.draft or tiny_draft(args.model, log_dir / "draft")
    prompt = long_prompt(args.model, args.prompt_tokens)
    flags = ["--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", str(args.streams + 2),
             "--prefill-step-size", str(args.prefill_step_size), "--disable-prefix-cache", "--specprefill",
             "--specprefill-draft-model", str(draft), "--specprefill-keep-pct", str(args.keep_pct), *args.flags.split()]
    results: dict = {"device": str(mx.default_device()), "host": platform.node(), "model": str(args.model), "draft": str(draft),
                     "flags": flags, "streams": args.streams, "commit": os.environ.get("BENCH_COMMIT", ""),
                     "mlx": mx.__version__, "runs": []}
    with serve(args.model, *flags, log_dir=log_dir, command=args.command.split() or None, startup_timeout=args.timeout) as server:
        httpx.post(f"{server.url}/v1/chat/completions", timeout=args.timeout, json={
            "model": server.model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})
        for i in range(args.repeats):
            for name, extra in (("dense", {"specprefill": False}), ("sparse", {"specprefill": True})):
                r = asyncio.run(measure(server.url, server.model, prompt, args.streams, args.warm_tokens, args.timeout, extra))
                r["kind"] = name
                results["runs"].append(r)
                print(name, json.dumps(r), flush=True)
        status = httpx.get(f"{server.url}/v1/status", timeout=30).json()["plugins"]["mtp-routing"]
        results["specprefill"], results["prefill"] = status["specprefill"], status.get("prefill")
    worst = {k: max(r["longest_gap_s"] for r in results["runs"] if r["kind"] == k) for k in ("dense", "sparse")}
    ttft = {k: min(r["ttft_s"] for r in results["runs"] if r["kind"] == k) for k in ("dense", "sparse")}
    results["summary"] = {
        "longest_gap_dense_s": worst["dense"], "longest_gap_sparse_s": worst["sparse"],
        "gap_ratio_sparse_over_dense": round(worst["sparse"] / worst["dense"], 2), "target_gap_ratio": 2.0,
        "ttft_dense_s": ttft["dense"], "ttft_sparse_s": ttft["sparse"], "ttft_speedup": round(ttft["dense"] / ttft["sparse"], 2),
    }
    out = args.out or REPO / "benchmarks" / "results" / f"specprefill_stall-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["summary"]))


if __name__ == "__main__":
    main()
