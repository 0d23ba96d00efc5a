#!/usr/bin/env python3
"""MTP's prefill tax through the real server: time to first token of a long prompt with and
without --enable-mtp, servers up at once, same prompts, same run.

Starts `vllm-mlx serve MODEL --continuous-batching --mllm --plugins mtp-routing` three times on
127.0.0.1 (defaults; --configs to choose):
  nomtp     without --enable-mtp
  mtp       --enable-mtp (the head takes the prompt's last --mtp-prompt-pairs positions, default 256)
  mtp_all   --enable-mtp --mtp-prompt-pairs all (the head over every prompt position: the former way)
then, each round, sends one new long prompt (stdlib source, about --prompt-tokens tokens, never
seen before, so no server's prefix cache helps) to every server in turn (rotating which goes
first), streaming, greedy, --max-tokens tokens, and records the time to the first content token
and the text, and the CPU seconds the server process spent on the request (/proc; the work done,
which other jobs on a shared machine do not inflate as they do wall time). Reports per config the
median TTFT and CPU seconds and the medians of per-round ratios against nomtp, and whether every
server produced the same greedy text for every prompt.

  python benchmarks/mtp_ttft.py --out benchmarks/results/mtp_ttft_cpu.json       # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test support package: support.*
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import record  # noqa: E402
from support import server as testing_server  # noqa: E402

TRAINED = ROOT / "models" / "tiny-qwen35-trained"
BASE = ["--continuous-batching", "--mllm", "--plugins", "mtp-routing"]
CONFIGS = {
    "nomtp": [],
    "mtp": ["--enable-mtp"],
    "mtp_all": ["--enable-mtp", "--mtp-prompt-pairs", "all"],
}


def prompts(tokenizer, n: int, tokens: int) -> list[str]:
    """n texts of about ``tokens`` tokens each, from different stdlib files (distinct from their
    first token: no prefix is shared)."""
    std = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(std.glob("*.py"), key=lambda f: hashlib.sha1(f.name.encode()).hexdigest())
    out, seen = [], set()
    for f in files:
        text = f.read_text(errors="ignore")
        ids = tokenizer.encode(text)
        if len(ids) < tokens + 50:
            continue
        body = tokenizer.decode(ids[:tokens])
        if body[:200] in seen:
            continue
        seen.add(body[:200])
        out.append(f"# {f.name}\n{body}")
        if len(out) == n:
            return out
    raise SystemExit("not enough stdlib source for the prompts")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ask(url: str, model: str, text: str, max_tokens: int, timeout: float) -> tuple[float, float, str, dict]:
    """(TTFT s, total s, greedy text, usage) of one streamed chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, parts, usage = None, [], {}
    with httpx.Client(base_url=url, timeout=timeout) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("error"):
                raise RuntimeError(str(ev["error"])[:300])
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                delta = ch.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
                if piece:
                    first = first if first is not None else time.perf_counter() - t0
                    parts.append(piece)
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, "".join(parts), usage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=TRAINED)
    ap.add_argument("--configs", default="nomtp,mtp,mtp_all")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, each with a new prompt, after a warm-up")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    names = [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or "nomtp" not in names:
        ap.error(f"--configs: known {sorted(CONFIGS)}, nomtp included; got {a.configs!r}")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(a.model))
    texts = prompts(tok, a.rounds + 1, a.prompt_tokens)
    result = {"benchmark": "mtp_ttft", "model": a.model.name, **record(), "prompt_tokens_target": a.prompt_tokens,
              "max_tokens": a.max_tokens, "configs": {n: BASE + CONFIGS[n] for n in names}, "rounds": []}
    log_dir = Path(tempfile.mkdtemp(prefix="mtp_ttft_"))
    with contextlib.ExitStack() as stack:
        servers = {n: stack.enter_context(testing_server.serve(a.model, *BASE, *CONFIGS[n], log_dir=log_dir,
                                                               startup_timeout=600))
                   for n in names}
        for rnd, text in enumerate(texts):
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            row: dict = {"round": rnd, "warm_up": rnd == 0, "order": order, "ttft_s": {}, "total_s": {}, "cpu_s": {},
                         "text": {}}
            for n in order:
                cpu0 = cpu_seconds(servers[n].proc.pid)
                ttft, total, out, usage = ask(servers[n].url, servers[n].model, text, a.max_tokens, a.timeout)
                row["cpu_s"][n] = round(cpu_seconds(servers[n].proc.pid) - cpu0, 2)
                row["ttft_s"][n], row["total_s"][n], row["text"][n] = round(ttft, 3), round(total, 3), out
                row["prompt_tokens"] = usage.get("prompt_tokens")
                print(f"mtp_ttft: round {rnd} {n}: TTFT {ttft:.2f} s, server CPU {row['cpu_s'][n]:.1f} s, "
                      f"{usage.get('prompt_tokens')} prompt tokens", flush=True)
            row["same_text"] = len(set(row["text"].values())) == 1
            result["rounds"].append(row)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
        for n in names:
            status = httpx.get(f"{servers[n].url}/v1/status", timeout=30).json()
            result.setdefault("mtp_status", {})[n] = status.get("mtp")
    timed = [r for r in result["rounds"] if not r["warm_up"]]
    result["summary"] = {
        n: {"ttft_median_s": round(statistics.median(r["ttft_s"][n] for r in timed), 3),
            "vs_nomtp_median": round(statistics.median(r["ttft_s"][n] / r["ttft_s"]["nomtp"] for r in timed), 3),
            "vs_nomtp_per_round": [round(r["ttft_s"][n] / r["ttft_s"]["nomtp"], 3) for r in timed],
            "server_cpu_median_s": round(statistics.median(r["cpu_s"][n] for r in timed), 2),
            "server_cpu_vs_nomtp_median": round(statistics.median(r["cpu_s"][n] / r["cpu_s"]["nomtp"] for r in timed), 3)}
        for n in names
    }
    result["same_greedy_text_every_round"] = all(r["same_text"] for r in result["rounds"])
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"summary": result["summary"], "same_text": result["same_greedy_text_every_round"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
