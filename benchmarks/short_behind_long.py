#!/usr/bin/env python3
"""A one-line question sent while another client's long prompt prefills: the question's time to first token.

Per round a fresh server (the committed trained model, ``--plugins mtp-routing --continuous-batching --mllm``) gets a
long prompt (``--prompt-lines`` lines of code, ``max_tokens`` 1), and ``--after-s`` later a short question
(``max_tokens`` 4); both times to first token are reported. With ``--base DIR`` a baseline checkout's plugin (put first
on PYTHONPATH) runs as "before", the servers alternating round by round; the prompts are the same for both.

  python benchmarks/short_behind_long.py --base /path/to/baseline-checkout --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*
sys.path.insert(0, str(REPO / "benchmarks"))  # lib.*
from lib.provenance import commit, device_line  # noqa: E402

from support.server import serve  # noqa: E402


def first_token_s(url: str, body: dict) -> float:
    """Seconds until the stream's first content (or reasoning) delta."""
    tic = time.perf_counter()
    with httpx.Client(base_url=url, timeout=1200) as client:
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
                    if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
                        break
    return time.perf_counter() - tic


def one_round(url: str, model: str, lines: int, after_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    code = "\n".join(f"def f{rng.randint(0, 10**6)}(x):\n    return x * {rng.randint(0, 99)}" for _ in range(lines))
    out: dict[str, float] = {}
    long = threading.Thread(target=lambda: out.__setitem__("long_ttft_s", first_token_s(url, {
        "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": code}]})))
    long.start()
    time.sleep(after_s)
    out["short_ttft_s"] = first_token_s(url, {"model": model, "max_tokens": 4,
                                               "messages": [{"role": "user", "content": f"What is {seed} + 2?"}]})
    long.join()
    status = httpx.get(url + "/v1/status", timeout=10).json()["plugins"]["mtp-routing"]["text_engine"]
    return {**out, "prompt_tokens_processed": status["prompt_tokens_processed"],
            "prompts_passed": status.get("prompts_passed")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--base", type=Path, help="baseline checkout (its plugin runs as 'before'); omitted: after only")
    ap.add_argument("--prompt-lines", type=int, default=330, help="the long prompt's lines of code (~21 tokens each)")
    ap.add_argument("--after-s", type=float, default=1.0, help="seconds between the long prompt and the question")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    variants = ([("before", {"PYTHONPATH": os.pathsep.join(filter(None, [str(a.base), os.environ.get("PYTHONPATH", "")]))})]
                if a.base else []) + [("after", {})]
    log_dir = REPO / "benchmarks" / "results" / "tmp"
    log_dir.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for r in range(a.rounds):
        for name, env in variants if r % 2 == 0 else variants[::-1]:
            with serve(a.model, "--plugins", "mtp-routing", "--continuous-batching", "--mllm", log_dir=log_dir,
                       env=env, startup_timeout=600) as server:
                rounds[name].append(one_round(server.url, str(a.model), a.prompt_lines, a.after_s, r))
            print(f"round {r} {name}: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rounds[name][-1].items()})}",
                  file=sys.stderr)
    summary = {name: {k: statistics.median(x[k] for x in rs) for k in ("short_ttft_s", "long_ttft_s")}
               for name, rs in rounds.items()}
    for name, s in summary.items():
        print(f"{name:<7} question's first token {s['short_ttft_s']:7.2f} s, the long prompt's {s['long_ttft_s']:7.2f} s "
              f"(medians of {a.rounds})")
    if a.out is not None:
        a.out.write_text(json.dumps({"commit": commit(), "device": device_line(), "args": {k: str(v) for k, v in vars(a).items()},
                                     "rounds": rounds, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
