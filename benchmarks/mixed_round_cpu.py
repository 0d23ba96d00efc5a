#!/usr/bin/env python3
"""Where a mixed round's CPU goes in the engine: each request's decode span, and the other requests' prefill inside it.

In one process, on the committed trained model (or ``--model``), the text engine serves ``mixed_load.py``'s round: its
four prompts at once, the second and fourth with a 224x224 image, ``--max-tokens`` each (end-of-reply ignored, so
every reply has that length). Per request: its first token's and last token's time, and the CPU seconds of prefill
(any row's, the vision tower included) that ran between the two. Then the same four prompts prefilled one at a time
with nothing decoding: the prefill's CPU seconds whole, against those of the round, where it ran in pieces between
decode steps. Everything is CPU seconds of this process, which other work on a shared machine does not inflate.

A request's "own share" is the part of its decode span that is not prefill: the rate at which it would have decoded
had every prefill of the round run before its first token (what the host and mlx-vlm's server do), over the rate it
got.

  python benchmarks/mixed_round_cpu.py --out benchmarks/results/mixed_round_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.media_engine import media_engine  # noqa: E402
from lib.provenance import commit, device_line  # noqa: E402
from mixed_load import messages  # noqa: E402

from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.state import TextRequest  # noqa: E402

TRAINED = ROOT / "models" / "tiny-qwen35-trained"
CONCURRENCY = 4  # mixed_load.py's round: requests 1 and 3 carry an image


class PrefillClock:
    """CPU seconds the runner spends in prefill items (chunks, pieces of layers, vision-tower pieces)."""

    def __init__(self, sched: BatchScheduler) -> None:
        self.seconds = 0.0
        run = sched.runner.prefill

        def timed(items: Any) -> Any:
            tic = time.process_time()
            try:
                return run(items)
            finally:
                self.seconds += time.process_time() - tic

        sched.runner.prefill = timed  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=TRAINED)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)

    engine = media_engine(a.model, max_num_seqs=CONCURRENCY)
    tokenizer, sched = engine.processor.tokenizer, engine.sched
    sched.eos_ids = set()  # every reply runs to max_tokens, as mixed_load.py's do on the model before its chat tune
    clock = PrefillClock(sched)

    def request(i: int, rid: str, max_tokens: int) -> TextRequest:
        msgs = messages(i, image=i % 2 == 1)
        options = SamplingOptions(max_tokens=max_tokens)
        if i % 2 == 0:
            return TextRequest(rid, tokenizer.encode(engine.render(msgs, 0)), options)
        prompt = engine.media_prompt(msgs)
        return TextRequest(rid, list(prompt.ids), options, media=prompt.media)

    def one_round(offset: int) -> dict:
        for i in range(CONCURRENCY):
            sched.add(request(offset + i, f"r{offset + i}", a.max_tokens))
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        steps: list[tuple[float, float]] = []  # (CPU seconds at the step's end, its prefill's CPU seconds)
        t0, clock.seconds = time.process_time(), 0.0
        while sched.has_work():
            before = clock.seconds
            outs = sched.step()
            now = time.process_time() - t0
            steps.append((now, clock.seconds - before))
            for o in outs:
                if o.new_token_ids:
                    first.setdefault(o.request_id, now)
                    last[o.request_id] = now
        out = []
        for i in range(CONCURRENCY):
            rid = f"r{offset + i}"
            span = last[rid] - first[rid]
            inside = sum(p for t, p in steps if first[rid] < t <= last[rid])
            out.append({"kind": "image" if i % 2 else "text", "first_token_cpu_s": first[rid], "span_cpu_s": span,
                        "prefill_in_span_cpu_s": inside, "own_share": (span - inside) / span if span else 1.0})
        return {"requests": out, "prefill_cpu_s": clock.seconds, "cpu_s": time.process_time() - t0}

    def alone(offset: int) -> float:
        """The round's four prompts prefilled one after another, nothing decoding: their prefill's CPU seconds."""
        clock.seconds = 0.0
        for i in range(CONCURRENCY):
            sched.add(request(offset + i, f"alone{offset + i}", 1))
            while sched.has_work():
                sched.step()
        return clock.seconds

    one_round(100)  # warm-up: every shape once
    rounds, whole = [], []
    for r in range(a.rounds):
        rounds.append(one_round(10 * r))
        whole.append(alone(10 * r))
        print(f"round {r}: " + ", ".join(f"{x['kind']} {x['first_token_cpu_s']:.2f}/{x['own_share']:.2f}"
                                         for x in rounds[-1]["requests"]) + " (first token CPU s / own share); "
              f"prefill {rounds[-1]['prefill_cpu_s']:.2f} CPU s in the round, {whole[-1]:.2f} alone", file=sys.stderr)

    def med(kind: str, key: str) -> float:
        return statistics.median(x[key] for r in rounds for x in r["requests"] if x["kind"] == kind)

    summary = {kind: {k: med(kind, k) for k in ("first_token_cpu_s", "prefill_in_span_cpu_s", "own_share")}
               for kind in ("text", "image")}
    summary["prefill_in_round_over_alone"] = statistics.median(r["prefill_cpu_s"] / w for r, w in zip(rounds, whole))
    report = {"commit": commit(), "device": device_line(), "model": str(a.model), "max_tokens": a.max_tokens,
              "rounds": rounds, "prefill_alone_cpu_s": whole, "summary": summary}
    print(f"medians of {a.rounds} rounds: text own share {summary['text']['own_share']:.2f}, image "
          f"{summary['image']['own_share']:.2f}; the round's prefill {summary['prefill_in_round_over_alone']:.2f}x "
          "its CPU prefilled alone")
    if a.out is not None:
        a.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
