#!/usr/bin/env python3
"""Mixed text + image load: the host alone, host + the plugin and mlx-vlm's own server, all up at once, alternated.

Each round sends CONCURRENCY streamed chat requests at once to one server, half of them with an image (temperature 0,
MAX_TOKENS each); the servers take turns round by round, so drift of the machine hits them alike. Reported per server:
per-request decode speed of text and of image requests (median tokens/s after the first token), aggregate tokens/s of
a round, each request's answer over its whole wait (tokens over the seconds from its send to its last token: "e2e"),
time to first token; then the ratios plugin / host and plugin / mlx-vlm.

  python benchmarks/mixed_load.py                       # the committed trained model, CPU
  python benchmarks/mixed_load.py --mtp                 # the plugin with --enable-mtp (the host without: its MTP drops images)
  python benchmarks/mixed_load.py --model PATH --no-peer
  python benchmarks/mixed_load.py --text-only --concurrency 1   # text decode alone against the host and mlx-vlm

mlx-vlm's server needs `mlx-audio` importable (`pip install --no-deps mlx-audio`); without it, --no-peer.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*
sys.path.insert(0, str(REPO / "benchmarks"))  # lib.*
from lib.provenance import commit, device_line  # noqa: E402

from support.server import free_port, serve  # noqa: E402

TEXTS = ["Write a Python function that checks whether a string is a palindrome.",
         "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
         "Explain what a hash map is in two sentences.",
         "class Queue:\n    def __init__(self):\n"]


def image_url(seed: int, size: tuple[int, int] = (224, 224)) -> str:
    from PIL import Image

    img = Image.new("RGB", size, ((seed * 70) % 256, (seed * 130) % 256, (seed * 200) % 256))
    for x in range(0, size[0], 12):
        for y in range(size[1]):
            img.putpixel((x, y), (255, 255 - x % 256, y % 256))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(i: int, image: bool) -> list[dict]:
    text = TEXTS[i % len(TEXTS)]
    if not image:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(i)}},
                                          {"type": "text", "text": "Describe this picture. " + text}]}]


async def one(client: httpx.AsyncClient, model: str, msgs: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            for c in data.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    tokens = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") else chunks
    span = (last - first) if first and last else 0.0
    # "decode": tokens/s after the first token; "e2e": the whole answer's tokens over the wait for it from the send
    return {"ttft": (first or time.perf_counter()) - t0, "tokens": tokens, "decode": (tokens - 1) / span if span > 0 else 0.0,
            "e2e": tokens / (last - t0) if last else 0.0}


async def round_of(url: str, model: str, concurrency: int, max_tokens: int, offset: int, images: bool = True) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        kinds = [images and i % 2 == 1 for i in range(concurrency)]  # half of them with an image
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(client, model, messages(offset + i, k), max_tokens) for i, k in enumerate(kinds)))
        wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": sum(r["tokens"] for r in res),
            "text": [r for r, k in zip(res, kinds) if not k], "image": [r for r, k in zip(res, kinds) if k]}


@contextlib.contextmanager
def peer_server(model: Path, max_num_seqs: int, log_dir: Path):
    port = free_port()
    # Its prefix cache on (off by default), checkpoints every 256 tokens: its best settings for repeated prompts. Its
    # disk tier in a folder of this run's own: by default it persists under ~/.cache/mlx-vlm, and a second run's
    # identical prompts (the same seeds) would hit what the first run left there.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "APC_ENABLED": "1", "APC_CHECKPOINT_INTERVAL_TOKENS": "256",
           "APC_DISK_PATH": tempfile.mkdtemp(prefix="mlx-vlm-apc-", dir=log_dir)}
    url = f"http://127.0.0.1:{port}"
    with open(log_dir / f"mlx-vlm-{port}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_vlm.server", "--model", str(model), "--host", "127.0.0.1",
                                 "--port", str(port), "--max-num-seqs", str(max_num_seqs)], stdout=log, stderr=log, env=env)
        yield from _until_up(proc, url, log.name)


def _until_up(proc: subprocess.Popen, url: str, log_name: str):
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"mlx-vlm server exited; see {log_name}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)


async def two_turns(url: str, model: str, seed: int) -> dict:
    """A conversation that resends its image: turn 2's time to first token and the prompt tokens it reused."""
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(seed, (448, 448))}},
                                          {"type": "text", "text": "What is in this picture? " + TEXTS[0]}]}]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        r = await client.post("/v1/chat/completions", json={"model": model, "messages": first, "max_tokens": 24, "temperature": 0})
        r.raise_for_status()
        reply = r.json()["choices"][0]["message"]["content"] or ""
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And what colour is it?"}]
        body = {"model": model, "messages": second, "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0, ttft, cached = time.perf_counter(), None, 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                # The first token, whichever field it lands in (a reasoning parser puts a thinking prompt's first
                # tokens in `reasoning`).
                if ttft is None and any((c.get("delta") or {}).get(k) for c in data.get("choices") or []
                                        for k in ("content", "reasoning", "reasoning_content", "tool_calls")):
                    ttft = time.perf_counter() - t0
                usage = data.get("usage") or {}
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached)
    return {"turn2_ttft_s": ttft or 0.0, "turn2_cached_tokens": cached}


def summary(rounds: list[dict]) -> dict:
    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs) if rs else 0.0

    text = [r for x in rounds for r in x["text"]]
    image = [r for x in rounds for r in x["image"]]
    return {"text_decode_tok_s": med(text, "decode"), "image_decode_tok_s": med(image, "decode"),
            "aggregate_tok_s": statistics.median(x["tokens"] / x["wall"] for x in rounds),
            "text_e2e_tok_s": med(text, "e2e"), "image_e2e_tok_s": med(image, "e2e"),
            "text_ttft_s": med(text, "ttft"), "image_ttft_s": med(image, "ttft")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per server, alternated")
    ap.add_argument("--mtp", action="store_true", help="--enable-mtp on the plugin")
    ap.add_argument("--text-only", action="store_true", help="no image requests (plain text decode against the others)")
    ap.add_argument("--no-peer", action="store_true", help="leave mlx-vlm's server out")
    ap.add_argument("--no-host", action="store_true", help="leave the host alone out")
    ap.add_argument("--second-turns", type=int, default=1, metavar="N",
                    help="two-turn conversations resending their image per server (each its own image), alternated")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    ap.add_argument("--server-cmd", default=None, help="replaces the `vllm-mlx` console script (e.g. the GPU launcher)")
    ap.add_argument("--plugin-args", default="", help="more flags for the plugin's server (e.g. \"--prefill-stall-ratio 1\")")
    a = ap.parse_args()
    log_dir = REPO / "benchmarks" / "results" / "tmp"
    log_dir.mkdir(parents=True, exist_ok=True)
    common = ("--continuous-batching", "--mllm", "--max-num-seqs", str(a.concurrency))
    plugin_flags = ("--plugins", "mtp-routing", *common, *(("--enable-mtp",) if a.mtp else ()), *shlex.split(a.plugin_args))
    with contextlib.ExitStack() as stack:
        cmd = shlex.split(a.server_cmd) if a.server_cmd else None
        servers = {} if a.no_host else {
            "host": stack.enter_context(serve(a.model, *common, log_dir=log_dir, command=cmd, startup_timeout=600)).url}
        servers["plugin"] = stack.enter_context(serve(a.model, *plugin_flags, log_dir=log_dir, command=cmd, startup_timeout=600)).url
        if not a.no_peer:
            servers["mlx-vlm"] = stack.enter_context(peer_server(a.model, a.concurrency, log_dir))
        model = str(a.model)
        for url in servers.values():  # warm-up: compile paths, first image
            asyncio.run(round_of(url, model, 2, 8, 100))
        rounds: dict[str, list[dict]] = {n: [] for n in servers}
        names = list(servers)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                rounds[name].append(asyncio.run(round_of(servers[name], model, a.concurrency, a.max_tokens, 10 * r,
                                                         not a.text_only)))
                print(f"round {r} {name}: {rounds[name][-1]['tokens']} tokens in {rounds[name][-1]['wall']:.1f}s", file=sys.stderr)
        pairs: dict[str, list[dict]] = {n: [] for n in servers}
        for i in range(a.second_turns):  # a new image each time, the same one for every server; the order rotates
            for name in names[i % len(names):] + names[: i % len(names)]:
                pairs[name].append(asyncio.run(two_turns(servers[name], model, 1000 + i)))
        turns = {n: {"turn2_ttft_s": statistics.median(t["turn2_ttft_s"] for t in ts), "turn2_ttft_all_s": [
            round(t["turn2_ttft_s"], 3) for t in ts], "turn2_cached_tokens": ts[-1]["turn2_cached_tokens"]} if ts else {}
            for n, ts in pairs.items()}
        status = httpx.get(servers["plugin"] + "/v1/status", timeout=10).json()["plugins"]["mtp-routing"]
    report = {"command": " ".join(sys.argv), "commit": commit(), "device": device_line(), "model": str(a.model),
              "concurrency": a.concurrency, "text_only": a.text_only, "max_tokens": a.max_tokens, "rounds": a.rounds,
              "plugin_mtp": a.mtp, "servers": {n: {**(summary(rs) if rs else {}), **turns[n]} for n, rs in rounds.items()},
              "plugin_routing": status.get("routing"), "plugin_mtp_acceptance": status.get("mtp", {}).get("acceptance_rate"),
              "plugin_mtp_media_rows": status.get("mtp", {}).get("media_rows")}
    keys = ["text_decode_tok_s", "image_decode_tok_s", "aggregate_tok_s", "text_e2e_tok_s", "image_e2e_tok_s",
            "text_ttft_s", "image_ttft_s"]
    rates = keys[:5]
    print(f"\nmixed load: concurrency {a.concurrency} ({'text only' if a.text_only else 'half with an image'}), {a.max_tokens} tokens, {a.rounds} rounds each, "
          f"plugin MTP {'on' if a.mtp else 'off'}")
    if a.rounds:
        print(f"{'server':<10}" + "".join(f"{k:>20}" for k in keys))
        for name, s in report["servers"].items():
            print(f"{name:<10}" + "".join(f"{s[k]:>20.3f}" for k in keys))
    for other in [n for n in servers if n != "plugin"]:
        p, o = report["servers"]["plugin"], report["servers"][other]
        ratios = {k: p[k] / o[k] if o.get(k) else float("nan") for k in rates} if a.rounds else {}
        # each conversation's pair (the same image on both servers, one after the other)
        ratios["turn2_ttft_each"] = [round(x / y, 3) for x, y in zip(p.get("turn2_ttft_all_s", []), o.get("turn2_ttft_all_s", [])) if y]
        report[f"plugin_vs_{other}"] = ratios
        if a.rounds:
            print(f"plugin / {other:<8}" + "".join(f"{ratios[k]:>20.2f}" for k in rates))
        if a.second_turns:
            print(f"second turn, plugin / {other} per conversation: {ratios['turn2_ttft_each']}")
    if a.second_turns:
        print("second turn resending a 448x448 image: " + ", ".join(
            f"{n} {t['turn2_ttft_s']:.2f} s ({t['turn2_cached_tokens']} cached)" for n, t in turns.items()))
    if report["plugin_mtp_acceptance"] is not None:
        media = report.get("plugin_mtp_media_rows") or {}
        print(f"plugin MTP acceptance: {report['plugin_mtp_acceptance']:.3f}"
              + (f" (image rows: {media['accepted']} of {media['drafted']} drafts)" if media.get("drafted") else ""))
    if a.out is not None:
        a.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
