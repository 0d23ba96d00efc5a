#!/usr/bin/env python3
"""Bounded soak through the real server: many requests, random hang-ups, bad inputs, images, cancels.

`vllm-mlx serve --plugins mtp-routing` on loopback with a small `--max-num-seqs`, queue and prefix-cache budget, and N
requests from C concurrent clients drawn from a seeded mix: complete text streams, streams the
client hangs up on after a few chunks, non-streamed text, Anthropic messages, image requests
(streamed, some hung up on), out-of-range parameters, broken inline images, over-context requests,
streams cancelled by id. Pass: no 500 (nor any status outside the expected set), every admission and
text-engine counter back at 0 within a few seconds, server memory (RSS) flat: the last quarter's
median within the tolerance of the second quarter's.

  python scripts/soak.py --requests 1000 --out benchmarks/results/soak-cpu.json

Prints a JSON summary last; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*

from support.server import Server, png_data_url, serve  # noqa: E402

KINDS = {  # weight of each request kind in the mix
    "stream": 30, "hangup": 15, "plain": 10, "anthropic": 5, "image": 8, "image_hangup": 4,
    "bad_param": 10, "bad_image": 5, "over_context": 4, "cancel": 5, "bad_json": 4,
}
EXPECTED = {  # statuses a kind may end with (503: refused while busy, by design)
    "stream": {200, 503}, "hangup": {200, 503}, "plain": {200, 503}, "anthropic": {200, 503}, "image": {200, 503},
    "image_hangup": {200, 503}, "bad_param": {400, 422}, "bad_image": {400}, "over_context": {400},
    "cancel": {200, 503}, "bad_json": {400, 422},
}
BAD_PARAMS = [{"seed": -1}, {"seed": 2**64}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"min_p": 3},
              {"stop": [1]}, {"max_tokens": 0}, {"frequency_penalty": 9}, {"presence_penalty": -9}]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@functools.cache
def over_context(model: str) -> str:
    """A prompt longer than the model's context on its own (every word is a token at least): a 400 before any prefill.
    (A max_tokens past the context is cut to what the prompt leaves, as the host does: not a refusal.)"""
    config = json.loads((Path(model) / "config.json").read_text())
    context = (config.get("text_config") or {}).get("max_position_embeddings") or config.get("max_position_embeddings") or 32768
    return "alpha beta gamma delta " * (int(context) // 4 + 256)


def chat(server: Server, content: object, **kw: object) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


def error_frame(lines: list[str]) -> dict | None:
    """The stream's error frame (``data: {"error": ...}``), or None. Parsed, not searched for: a token whose text is
    ``error`` makes a frame with ``"content":"error"`` (one stream of a 1000-request soak, counted as failed)."""
    for line in lines:
        if line.startswith("data: {"):
            try:
                frame = json.loads(line[6:])
            except ValueError:
                continue
            if "error" in frame:
                return frame["error"] if isinstance(frame["error"], dict) else {"message": frame["error"]}
    return None


async def one(client: httpx.AsyncClient, server: Server, kind: str, rng: random.Random) -> tuple[str, int, str]:
    text = rng.choice(["def f(x):", "import os", "class A:", "for i in range(3):", "The sky is"])
    image = [{"type": "text", "text": "describe"},
             {"type": "image_url", "image_url": {"url": png_data_url((rng.randrange(256), 0, 0), size=32)}}]
    if kind in ("stream", "hangup", "cancel", "image", "image_hangup"):
        payload = chat(server, image if kind.startswith("image") else text, stream=True,
                       max_tokens=rng.randint(8, 48) if kind in ("stream", "image") else 400)
        if kind == "stream" and rng.random() < 0.3:
            payload.update(temperature=0.8, seed=rng.randrange(2**32), top_p=0.9)
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            if r.status_code != 200:
                await r.aread()
                return kind, r.status_code, r.text[:200]
            chunks, lines = 0, []
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data: {") and '"content"' in line:
                    chunks += 1
                    if kind in ("hangup", "image_hangup") and chunks >= rng.randint(1, 3):
                        return kind, 200, "hung up"
                    if kind == "cancel" and chunks == 2:
                        rid = json.loads(lines[0][6:])["id"]
                        await client.post(f"/v1/requests/{rid}/cancel")
            error = error_frame(lines)
            if error is not None and kind != "cancel":
                return kind, 500 if error.get("code") == 500 else 299, json.dumps(error)[:300]
            return kind, 200, ""
    if kind == "plain":
        r = await client.post("/v1/chat/completions", json=chat(server, text, max_tokens=rng.randint(4, 24)))
    elif kind == "anthropic":
        r = await client.post("/v1/messages", json={"model": server.model, "max_tokens": 12,
                                                     "messages": [{"role": "user", "content": text}]})
    elif kind == "bad_param":
        r = await client.post("/v1/chat/completions", json=chat(server, text, **{"max_tokens": 8, **rng.choice(BAD_PARAMS)}))
    elif kind == "bad_image":
        url = rng.choice(["data:image/png;base64,@@notbase64", "data:image/png;base64,QUJDRA=="])
        r = await client.post("/v1/chat/completions", json=chat(server, [{"type": "image_url", "image_url": {"url": url}}], max_tokens=4))
    elif kind == "over_context":
        r = await client.post("/v1/chat/completions", json=chat(server, over_context(server.model), max_tokens=8))
    else:  # bad_json
        r = await client.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    return kind, r.status_code, r.text[:200] if r.status_code >= 400 else ""


def counters(server: Server) -> dict:
    s = server.get("/v1/status", timeout=30).json()["plugins"]["mtp-routing"]
    a, t = s["admission"], s["text_engine"]
    return {"running": a["running"], "queued": a["queued"], "reserved_bytes": a["reserved_bytes"],
            "text_running": t["running"], "text_prefilling": t["prefilling"], "text_waiting": t["waiting"]}


async def drive(server: Server, n: int, concurrency: int, seed: int) -> tuple[list[tuple[str, int, str]], list[tuple[int, int]]]:
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
    results: list[tuple[str, int, str]] = []
    memory: list[tuple[int, int]] = []
    queue: asyncio.Queue[str] = asyncio.Queue()
    for k in kinds:
        queue.put_nowait(k)

    async def worker(i: int) -> None:
        wrng = random.Random(seed * 1000 + i)
        async with server.async_client(timeout=180) as client:
            while not queue.empty():
                kind = queue.get_nowait()
                try:
                    results.append(await one(client, server, kind, wrng))
                except httpx.HTTPError as exc:
                    results.append((kind, -1, f"{type(exc).__name__}: {exc}"))
                if len(results) % 50 == 0:
                    memory.append((len(results), rss_bytes(server.proc.pid)))

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return results, memory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed relative RSS growth, Q2 to Q4")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    # The prefix cache holds up to --cache-memory-mb of snapshots by design (default 20% of RAM: GBs, far more
    # than a soak fills), so RSS would grow with it: a small budget reaches its bound early, the soak churns it
    # (evictions), and RSS staying flat then says nothing else accumulates.
    flags = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "4",
             "--scheduler-max-queue", "8", "--scheduler-queue-timeout", "60", "--cache-memory-mb", "16")
    log_dir = Path("/tmp/soak_logs")
    log_dir.mkdir(exist_ok=True)
    with serve(args.model, *flags, log_dir=log_dir) as server:
        t0 = time.monotonic()
        results, memory = asyncio.run(drive(server, args.requests, args.concurrency, args.seed))
        elapsed = time.monotonic() - t0
        deadline, final = time.monotonic() + 5, counters(server)
        while any(final.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            final = counters(server)
        health = server.get("/health", timeout=10).status_code
        cache = server.get("/v1/status", timeout=30).json()["plugins"]["mtp-routing"]["prefix_cache"]
        log = server.log()
    statuses = Counter(f"{k}:{s}" for k, s, _ in results)
    unexpected = [(k, s, d) for k, s, d in results if s not in EXPECTED[k]]
    rss = [m for _, m in memory]
    quarter = max(len(rss) // 4, 1)
    q2, q4 = (statistics.median(rss[quarter : 2 * quarter] or rss), statistics.median(rss[-quarter:])) if rss else (0, 0)
    growth = (q4 - q2) / q2 if q2 else 0.0
    summary = {
        "requests": len(results), "seconds": round(elapsed, 1), "concurrency": args.concurrency, "seed": args.seed,
        "statuses": dict(sorted(statuses.items())), "status_500": sum(1 for _, s, _ in results if s == 500),
        "unexpected": unexpected[:20], "unexpected_count": len(unexpected), "final_counters": final,
        "health": health, "rss_mib_q2": round(q2 / 2**20, 1), "rss_mib_q4": round(q4 / 2**20, 1),
        "rss_growth": round(growth, 4), "rss_samples_mib": [round(m / 2**20, 1) for m in rss],
        "tracebacks_in_log": log.count("Traceback"),
        "prefix_cache": {k: cache.get(k) for k in ("bytes", "budget_bytes", "entries", "evictions", "hits")},
    }
    ok = (len(results) == args.requests and not unexpected and not any(final.values()) and health == 200
          and growth <= args.rss_tolerance)
    summary["pass"] = ok
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
