#!/usr/bin/env python3
"""A lone long prompt, nothing cached: the plugin's time to first token against the host alone's.

Both servers up at once on loopback, same model and flags (the host alone: ``vllm-mlx serve MODEL
--continuous-batching --mllm``; the plugin: the same plus ``--plugins mtp-routing``). Each round sends one prompt of
P tokens to each server in turn (the order alternating round by round), non-streamed with max_tokens 1, so the
answer's time is the time to first token; every prompt opens with its own round and server tag, so neither server
has any of it cached. Reported: each server's seconds per round and the plugin/host ratio of each round's pair
(the median and the range), which cancels most of the machine's drift. Beside the seconds, each answer's CPU
seconds (the server process's user + system time over the request, all its threads): where other work shares the
machine, the wall clock measures the machine's load as much as the server, CPU time much less so.

  python benchmarks/cold_ttft.py --prompt-tokens 10000 16000 --rounds 2
  python benchmarks/cold_ttft.py --plugin-flags "--prefill-stall-ratio 0"    # the plugin without the stall bound

Writes benchmarks/results/cold_ttft-<device>.json (or --out); the last stdout line is the JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*
sys.path.insert(0, str(REPO / "benchmarks"))  # lib.*

from lib.prompts import long_prompt  # noqa: E402

from support.server import serve  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ask(url: str, model: str, content: str, timeout: float, pid: int) -> tuple[float, float, int]:
    """(seconds to the answer, the server's CPU seconds for it, prompt tokens)."""
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=timeout, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0, cpu_seconds(pid) - cpu0, int(r.json()["usage"]["prompt_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[10000])
    ap.add_argument("--rounds", type=int, default=2, help="pairs per prompt length")
    ap.add_argument("--flags", default="", help="extra serve flags for both servers")
    ap.add_argument("--plugin-flags", default="", help="extra serve flags for the plugin's server")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--server-cmd", default=None, help="replaces the `vllm-mlx` console script (e.g. the GPU launcher)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import mlx.core as mx

    base = ["--continuous-batching", "--mllm", *args.flags.split()]
    variants = {"host": base, "plugin": [*base, "--plugins", "mtp-routing", *args.plugin_flags.split()]}
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "cold_ttft_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": str(mx.default_device()), "host": platform.node(), "model": str(args.model),
                     "flags": variants, "commit": os.environ.get("BENCH_COMMIT", ""), "lengths": {}}
    with contextlib.ExitStack() as stack:
        command = shlex.split(args.server_cmd) if args.server_cmd else None
        servers = {name: stack.enter_context(serve(args.model, *flags, log_dir=log_dir, startup_timeout=args.timeout,
                                                   command=command))
                   for name, flags in variants.items()}
        for server in servers.values():  # first-use costs out of the way
            ask(server.url, server.model, "warm up", args.timeout, server.proc.pid)
        for tokens in args.prompt_tokens:
            prompt = long_prompt(args.model, tokens, room=24)  # room for the tag too
            rounds = []
            for k in range(args.rounds):
                order = list(servers) if k % 2 == 0 else list(reversed(servers))
                pair = {}
                for name in order:
                    seconds, cpu, prompt_tokens = ask(servers[name].url, servers[name].model,
                                                      f"[{tokens} {k} {name}] {prompt}", args.timeout, servers[name].proc.pid)
                    pair[name] = {"s": round(seconds, 2), "cpu_s": round(cpu, 2), "prompt_tokens": prompt_tokens}
                pair["ratio"] = round(pair["plugin"]["s"] / pair["host"]["s"], 3)
                pair["cpu_ratio"] = round(pair["plugin"]["cpu_s"] / pair["host"]["cpu_s"], 3)
                rounds.append(pair)
                print(tokens, k, json.dumps(pair), flush=True)
            ratios, cpu = [r["ratio"] for r in rounds], [r["cpu_ratio"] for r in rounds]
            results["lengths"][str(tokens)] = {"rounds": rounds, "ratio_median": round(statistics.median(ratios), 3),
                                               "ratio_min": min(ratios), "ratio_max": max(ratios),
                                               "cpu_ratio_median": round(statistics.median(cpu), 3),
                                               "cpu_ratio_min": min(cpu), "cpu_ratio_max": max(cpu)}
        with contextlib.suppress(Exception):
            results["plugin_prefill"] = httpx.get(f"{servers['plugin'].url}/v1/status", timeout=30).json()[
                "plugins"]["mtp-routing"].get("prefill")
    kind = "gpu" if mx.default_device() == mx.gpu else "cpu"
    out = args.out or REPO / "benchmarks" / "results" / f"cold_ttft-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "flags"}))


if __name__ == "__main__":
    main()
