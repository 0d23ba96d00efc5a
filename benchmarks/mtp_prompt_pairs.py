#!/usr/bin/env python3
"""What the MTP head over the prompt costs and buys (``--mtp-prompt-pairs``), on the trained model
(models/tiny-qwen35-trained, its own head: real acceptance).

Prefill: one --prefill-tokens prompt prefilled as the engine does (``runner.prefill_forward``, in
--prefill-chunk chunks: the server's calibrated chunk on the 2-core CPU is 16), without MTP and
with MTP at each setting, in rotating order for --rounds rounds; wall and process CPU seconds (CPU
time is the work done, which other jobs on a shared machine do not inflate as they do wall time).
Acceptance: --prompts held-out-style stdlib prompts of --prompt-tokens tokens decoded greedily in
one batch, plain and with per-row MTP (k = 1, every step drafting) at each setting; acceptance and
whether every output equals plain decoding's.

  python benchmarks/mtp_prompt_pairs.py --out benchmarks/results/mtp_prompt_pairs_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from mtp_decode_bench import load_bundle, make_prompts  # noqa: E402
from provenance import record  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.runner import prefill_forward  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.spec.proposer import MTPProposer  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.state import PrefillState, TextRequest  # noqa: E402


def decode(bundle, tok, prompts: list[list[int]], max_tokens: int, strategy: MTPDecode | None,
           chunk: int) -> list[list[int]]:
    """Greedy outputs, the prompts in one batch (``strategy``: None for plain decoding)."""
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=len(prompts), prefill_step_size=chunk, eos_token_ids=[],
                           decode=strategy)
    for i, p in enumerate(prompts):
        sched.add(TextRequest(str(i), p, SamplingOptions(max_tokens=max_tokens)))
    out = {}
    while sched.has_work():
        for o in sched.step():
            if o.finished:
                out[int(o.request_id)] = o.token_ids
    return [out[i] for i in range(len(prompts))]


def prefill_seconds(bundle, ids: list[int], chunk: int, proposer: MTPProposer | None) -> tuple[float, float]:
    """(wall, process CPU) seconds of prefilling ``ids`` (all but the last token) as the engine does (``proposer``:
    the MTP head's, or None without MTP)."""
    tokens = mx.array(ids[:-1], dtype=mx.uint32)[None]
    n = tokens.shape[1]
    state = PrefillState(backbone=bundle.model.make_cache(), prefill_to=n)
    wall, cpu = time.perf_counter(), time.process_time()
    for s in range(0, n, chunk):
        prefill_forward(bundle.model, proposer, tokens[:, s : s + chunk], state)  # advances state.prefilled
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pairs", default="all,256", help="settings of --mtp-prompt-pairs to compare")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (the window starts at a chunk)")
    ap.add_argument("--prefill-tokens", type=int, default=3000, help="0: no prefill timing")
    ap.add_argument("--prefill-chunk", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="timed prefill rounds after a warm-up")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    path, bundle, tok, source = load_bundle(None)
    settings = a.pairs.split(",")
    result = {"benchmark": "mtp_prompt_pairs", "model": path.name, "acceptance_source": source, **record(),
              "prompts": a.prompts, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens, "chunk": a.chunk,
              "prefill_tokens": a.prefill_tokens, "prefill_chunk": a.prefill_chunk, "rows": []}

    def write() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")

    if a.prefill_tokens:
        result["prefill"] = prefill_costs(bundle, tok, settings, a)
        print(json.dumps(result["prefill"]), flush=True)
        write()

    prompts = make_prompts(tok, a.prompts, a.prompt_tokens)
    ref = decode(bundle, tok, prompts, a.max_tokens, None, a.chunk)
    for setting in settings:
        pairs = None if setting == "all" else int(setting)
        strategy = MTPDecode(bundle.mtp, k=1, adaptive=False, prompt_pairs=pairs)
        t = time.perf_counter()
        out = decode(bundle, tok, prompts, a.max_tokens, strategy, a.chunk)
        s = strategy.stats()
        row = {"prompt_pairs": setting, "acceptance": round(s["acceptance_rate"], 3), "drafted": s["drafted"],
               "accepted": s["accepted"], "exact": out == ref, "seconds": round(time.perf_counter() - t, 1)}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        write()
    return 0


def prefill_costs(bundle, tok, settings: list[str], a: argparse.Namespace) -> dict:
    ids = make_prompts(tok, 1, a.prefill_tokens)[0]
    strategies: dict[str, MTPProposer | None] = {"nomtp": None}  # the prefill's proposer: none without MTP
    for x in settings:
        strategies[f"mtp_{x}"] = MTPProposer(bundle.mtp, 1, prompt_pairs=None if x == "all" else int(x))
    names = list(strategies)
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(a.rounds + 1):
        for n in names[r % len(names):] + names[: r % len(names)]:
            t = prefill_seconds(bundle, ids, a.prefill_chunk, strategies[n])
            if r:
                times[n].append(t)
            print(f"mtp_prompt_pairs: prefill round {r} {n}: {t[0]:.2f} s wall, {t[1]:.2f} s CPU", flush=True)
    return {
        n: {"wall_median_s": round(statistics.median(w for w, _ in times[n]), 3),
            "cpu_median_s": round(statistics.median(c for _, c in times[n]), 3),
            "cpu_vs_nomtp_per_round": [round(c / c0, 3) for (_, c), (_, c0) in zip(times[n], times["nomtp"])],
            "cpu_vs_nomtp_median": round(statistics.median(c / c0 for (_, c), (_, c0) in zip(times[n], times["nomtp"])), 3),
            "wall_vs_nomtp_median": round(statistics.median(w / w0 for (w, _), (w0, _) in zip(times[n], times["nomtp"])), 3)}
        for n in names
    }


if __name__ == "__main__":
    sys.exit(main())
