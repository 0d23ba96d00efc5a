#!/usr/bin/env python3
"""Where a SpecPrefill scoring's time goes, and what its draft chunk size costs (issue 38).

One prompt, random weights (``specprefill_speed.py``'s shapes), in process, median of ``--repeats``:
  dense            the target's dense prefill (the ``BatchScheduler``, ``--prefill-step-size`` chunks): the reference;
  prefill@C        the engine's ``ScoringJob`` over the prompt in chunks of C tokens, each evaluated before the next;
  prefill@C async  the same chunks, each launched with ``mx.async_eval`` while the next one is built;
  look-ahead       the job's last piece: the look-ahead, the scores and the selection (the scoring's other part).
Every time is also given over the dense prefill's.

  python benchmarks/specprefill_scoring_profile.py --smoke
  python benchmarks/specprefill_scoring_profile.py --tokens 32768 --chunks 2048,4096,8192,16384 --out $OUT/specprefill_scoring_profile-gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-shape", default="qwen35-9b")
    ap.add_argument("--draft-shape", default="attn-0.5b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunks", default="2048,4096,8192,16384")
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 512 tokens (a logic check on CPU)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.smoke:
        a.target_shape, a.draft_shape, a.tokens, a.chunks, a.repeats = "small", "small-attn", 512, "128,256", 1

    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer
    from specprefill_speed import TRAINED, Bench, prompt_ids, random_model, versions

    from vllm_mlx_mtp_routing.specprefill.scoring import ScoringJob
    from vllm_mlx_mtp_routing.specprefill.settings import SpecPrefillSettings

    model, _ = random_model(a.target_shape, mx.bfloat16)
    draft, _ = random_model(a.draft_shape, mx.bfloat16)
    tokenizer = load_tokenizer(TRAINED)
    prompt = prompt_ids(tokenizer, a.tokens, False, seed=a.tokens)
    bench = Bench(model, tokenizer, a.prefill_step_size)

    def score(chunk: int, overlap: bool) -> tuple[float, float]:
        """The engine's scoring job in ``chunk``-token pieces: (its prompt prefill's seconds, the look-ahead's and the
        selection's)."""
        job = ScoringJob(draft, prompt, 0, 0.2, 0.0, SpecPrefillSettings(), chunk)
        mx.clear_cache()
        mx.synchronize()
        tic = time.perf_counter()
        while job.prefilled < job.to_prefill:
            job.advance(overlap)
        mx.synchronize()
        prefilled = time.perf_counter()
        job.advance()
        return prefilled - tic, time.perf_counter() - prefilled

    bench.dense(prompt[: min(len(prompt), 2048)])  # warm-up: kernels compiled, buffers cached
    score(a.prefill_step_size, False)
    dense = statistics.median(bench.dense(prompt) for _ in range(a.repeats))
    report: dict = {"versions": versions(), "args": {k: str(v) for k, v in vars(a).items()}, "dense_s": round(dense, 4), "rows": []}
    for chunk in (int(c) for c in a.chunks.split(",")):
        for overlap in (False, True):
            runs = [score(chunk, overlap) for _ in range(a.repeats)]
            t = statistics.median(r[0] for r in runs)
            row = {"what": f"prefill@{chunk}" + (" async" if overlap else ""), "s": round(t, 4), "over_dense": round(t / dense, 4)}
            if not report["rows"]:
                r = statistics.median(r[1] for r in runs)
                report["rows"].append({"what": "look-ahead + importance", "s": round(r, 4), "over_dense": round(r / dense, 4)})
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
