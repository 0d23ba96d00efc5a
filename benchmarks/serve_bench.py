#!/usr/bin/env python3
"""Serving benchmark: the real `vllm-mlx serve`, host alone and host + the mtp-routing plugin.

Starts the server twice on 127.0.0.1 (free port) with the same flags,
    vllm-mlx serve MODEL --continuous-batching --mllm [--enable-mtp]             (host)
    ... the same ... --plugins mtp-routing [PLUGIN FLAGS]                          (plugin)
drives both through the HTTP API with streaming chat completions (temperature 0) and reports per
configuration: decode tok/s per request and aggregate at each concurrency, TTFT p50/p95, MTP
acceptance when /v1/status reports one (the plugin's under status["plugins"]["mtp-routing"]), and a
mixed text+image workload with per-path throughput. Ratios plugin/host come from the same run.

Writes JSON, a Markdown table and a PNG plot (matplotlib: the `bench` extra) to benchmarks/results/tmp/
(ignored by git) unless --out-dir says where, and prints the tables and the files' names. A result that
docs/benchmarks.md cites is kept in benchmarks/results/ (see benchmarks/README.md).

  python benchmarks/serve_bench.py --quick                    # < 60 s on 2 CPU cores
  python benchmarks/serve_bench.py --model trained            # models/tiny-qwen35-trained
  python benchmarks/serve_bench.py --model /path/to/qwen3.5-vlm --max-tokens 256
  python benchmarks/serve_bench.py --no-plugin                # host only
  python benchmarks/serve_bench.py --server-cmd "python benchmarks/lib/vllm_mlx_launcher.py --site /root/site"
                                                              # packages from `pip install --target`
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from any directory
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*
from support import server as testing_server  # noqa: E402
from support.server import Server  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from lib.provenance import commit as git_commit, device_line  # noqa: E402
from lib.report import finish, random_weights  # noqa: E402

TRAINED = REPO / "models" / "tiny-qwen35-trained"

# Code prompts in the style of the trained model's corpus; different lengths on purpose.
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = ",
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n",
    "for i, line in enumerate(open(path)):\n",
    "def parse_header(line):\n    \"\"\"Parse a Content-type like header.\n\n    Return the main content-type "
    "and a dictionary of options.\n    \"\"\"\n    parts = _parseparam(';' + line)\n",
    "try:\n    import threading\nexcept ImportError:\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, ",
    "# Copyright 2001-2019 by Vinay Sajip. All Rights Reserved.\n\"\"\"\nLogging package for Python.\n\"\"\"\n\nimport ",
]


# ---------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------


def serve(model: Path, flags: list[str], log_dir: Path, timeout: float = 300.0,
          server_cmd: list[str] | None = None) -> contextlib.AbstractContextManager[Server]:
    """The project's server helper; ``server_cmd`` replaces the ``vllm-mlx`` console script."""
    return testing_server.serve(model, *flags, log_dir=log_dir, startup_timeout=timeout, command=server_cmd)


# ---------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------


@dataclass
class Result:
    path: str  # "text" or "media"
    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    total: float = 0.0
    error: str = ""
    stamps: list[float] = field(default_factory=list)

    @property
    def decode_tps(self) -> float | None:
        # tokens after the first over the time after the first: the decode rate the client saw
        if self.tokens < 2 or self.total <= self.ttft:
            return None
        return (self.tokens - 1) / (self.total - self.ttft)


def image_data_url(seed: int, size: int = 64) -> str:
    from PIL import Image

    rgb = ((seed * 97) % 256, (seed * 57 + 80) % 256, (seed * 31 + 160) % 256)
    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages_for(i: int, media: bool) -> list[dict]:
    text = "Continue this Python code:\n" + PROMPTS[i % len(PROMPTS)]
    if not media:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(i)}},
                                         {"type": "text", "text": "Describe the image, then " + text}]}]


async def one_request(client: httpx.AsyncClient, model: str, i: int, media: bool, max_tokens: int) -> Result:
    body = {"model": model, "messages": messages_for(i, media), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result("media" if media else "text", ok=False)
    t0 = time.perf_counter()
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if ev.get("error"):
                    res.error = str(ev["error"])[:200]
                    return res
                if ev.get("usage"):
                    usage_tokens = ev["usage"].get("completion_tokens")
                for ch in ev.get("choices") or []:
                    delta = ch.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                        now = time.perf_counter() - t0
                        res.stamps.append(now)
                        chunks += 1
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.total = time.perf_counter() - t0
    res.ttft = res.stamps[0] if res.stamps else res.total
    res.tokens = usage_tokens if usage_tokens else chunks
    res.ok = True
    return res


async def run_round(url: str, model: str, concurrency: int, n: int, max_tokens: int, media_every: int,
                    offset: int) -> tuple[list[Result], float]:
    """n requests, at most `concurrency` in flight; every media_every-th one carries an image."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def go(i: int) -> Result:
            async with sem:
                media = media_every > 0 and i % media_every == media_every - 1
                return await one_request(client, model, offset + i, media, max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(i) for i in range(n)))
        return list(results), time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    tps = [r.decode_tps for r in ok if r.decode_tps is not None]
    ttft = [r.ttft for r in ok]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if not r.ok][:3],
        "completion_tokens": tokens,
        "wall_s": wall,
        "aggregate_tok_s": tokens / wall if wall > 0 else None,
        "decode_tok_s_per_request_mean": statistics.fmean(tps) if tps else None,
        "decode_tok_s_per_request_p50": pct(tps, 0.5),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p95_s": pct(ttft, 0.95),
    }


def find_acceptance(obj, path: str = "") -> dict:
    """Every numeric entry whose key mentions acceptance, anywhere under obj."""
    found = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}.{k}" if path else str(k)
            if "accept" in str(k).lower() and isinstance(v, (int, float)) and not isinstance(v, bool):
                found[p] = v
            else:
                found.update(find_acceptance(v, p))
    return found


class Interrupted(Exception):
    """SIGTERM (e.g. from `timeout`): stop measuring, keep the rounds done so far."""


def _raise_interrupted(signum, frame) -> None:
    # once: `timeout` signals the process and then its group, and the second must not cut the
    # server's shutdown or the report short
    signal.signal(signum, signal.SIG_IGN)
    raise Interrupted(f"signal {signum}")


def bench_config(name: str, model: Path, flags: list[str], a, log_dir: Path) -> dict:
    out: dict = {"name": name, "flags": flags, "text": {}}
    t0 = time.perf_counter()
    with serve(model, flags, log_dir, server_cmd=shlex.split(a.server_cmd) if a.server_cmd else None) as srv:
        out["startup_s"] = time.perf_counter() - t0
        try:
            measure(srv, name, a, out)
        except Interrupted as e:
            out["interrupted"] = str(e)
    return out


def measure(srv: Server, name: str, a, out: dict) -> None:
    warm_up(srv, a, media_every=2 if a.mixed else 0)
    rounds = out["text"]
    for c in a.concurrency:
        n = max(c, int(c * a.requests_per_slot))
        res, wall = asyncio.run(run_round(srv.url, srv.model, c, n, a.max_tokens, 0, c * 100))
        rounds[str(c)] = summarize(res, wall)
        print(f"[{name}] c={c}: {progress(rounds[str(c)])}", file=sys.stderr, flush=True)
    if a.mixed:
        c = a.mixed_concurrency
        res, wall = asyncio.run(run_round(srv.url, srv.model, c, max(c, 2 * c if not a.quick else c),
                                          a.max_tokens, 2, 5000))
        out["mixed"] = {"concurrency": c, "all": summarize(res, wall),
                        "text": summarize([r for r in res if r.path == "text"], wall),
                        "media": summarize([r for r in res if r.path == "media"], wall)}
        print(f"[{name}] mixed: {progress(out['mixed']['all'])}", file=sys.stderr, flush=True)
    record_status(srv, out)


def warm_up(srv: Server, a, media_every: int = 0) -> None:
    """Compiles, caches and (media_every > 0) the first image path, kept out of the numbers;
    --warmup-all also meets every batch size once (a GPU backend compiles kernels per shape)."""
    asyncio.run(run_round(srv.url, srv.model, 2, 2, 8, media_every, 10_000))
    for c in a.concurrency if a.warmup_all else []:
        asyncio.run(run_round(srv.url, srv.model, c, c, 8, 0, 20_000))


def record_status(srv: Server, out: dict) -> None:
    """The server's MTP acceptance and the plugin's routing, text-path and MTP stats, into out."""
    with contextlib.suppress(Exception):
        status = httpx.get(f"{srv.url}/v1/status", timeout=10).json()
        out["mtp_acceptance"] = find_acceptance(status)
        out["host_mtp_status"] = status.get("mtp")
        if "plugins" in status:
            plug = status["plugins"].get("mtp-routing", {})
            out["plugin_status"] = {k: plug.get(k) for k in ("routing", "text_path", "text_engine", "mtp")}


def bench_interleaved(configs: list[tuple[str, list[str]]], model: Path, a, log_dir: Path) -> list[dict]:
    """Both servers up at once (one GPU, two processes); per concurrency, ``a.interleave`` rounds
    each, alternating which server goes first: a slow phase of the machine (the GPU host's CPU
    busy for a second or two slows a launch-bound model 3-4x) then weighs on both alike, where
    measuring one server after the other puts it all on one side."""
    cmd = shlex.split(a.server_cmd) if a.server_cmd else None
    outs = [{"name": n, "flags": f, "text": {}, "interleaved_rounds": a.interleave} for n, f in configs]
    with contextlib.ExitStack() as stack:
        srvs = []
        for out, (_, flags) in zip(outs, configs):
            t0 = time.perf_counter()
            srvs.append(stack.enter_context(serve(model, flags, log_dir, server_cmd=cmd)))
            out["startup_s"] = time.perf_counter() - t0
        for srv in srvs:
            warm_up(srv, a)
        try:
            for c in a.concurrency:
                n = max(c, int(c * a.requests_per_slot))
                acc = [([], 0.0) for _ in srvs]
                for r in range(a.interleave):
                    order = range(len(srvs)) if r % 2 == 0 else reversed(range(len(srvs)))
                    for i in order:
                        res, wall = asyncio.run(run_round(srvs[i].url, srvs[i].model, c, n, a.max_tokens, 0, c * 100))
                        acc[i] = (acc[i][0] + res, acc[i][1] + wall)
                for out, (res, wall) in zip(outs, acc):
                    out["text"][str(c)] = summarize(res, wall)
                    print(f"[{out['name']}] c={c}: {progress(out['text'][str(c)])}", file=sys.stderr, flush=True)
        except Interrupted as e:
            for out in outs:
                out["interrupted"] = str(e)
        for out, srv in zip(outs, srvs):
            record_status(srv, out)
    return outs


def ratios(host: dict, plugin: dict) -> dict:
    def r(x, y):
        return (x / y) if (x is not None and y) else None

    out = {"text": {}}
    for c, h in host["text"].items():
        p = plugin["text"].get(c)
        if p:
            out["text"][c] = {
                "aggregate_tok_s": r(p["aggregate_tok_s"], h["aggregate_tok_s"]),
                "decode_tok_s_per_request": r(p["decode_tok_s_per_request_mean"], h["decode_tok_s_per_request_mean"]),
                "ttft_p50": r(p["ttft_p50_s"], h["ttft_p50_s"]),
            }
    if "mixed" in host and "mixed" in plugin:
        out["mixed"] = {k: r(plugin["mixed"][k]["aggregate_tok_s"], host["mixed"][k]["aggregate_tok_s"])
                        for k in ("all", "text", "media")}
    return out


# ---------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------


def progress(s: dict) -> str:
    """One round on one line, while the run goes on."""
    return (f"{s['requests']} requests, {s['completion_tokens']} tokens, {fmt(s['aggregate_tok_s'])} tok/s aggregate, "
            f"TTFT p50 {fmt(s['ttft_p50_s'], 3)} s, {s['errors']} errors")


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(report: dict) -> str:
    lines = [f"Model: `{report['model']}`  ", f"Device: {report['device']}  ",
             f"Command: `{report['command']}`", ""]
    lines.append("| config | conc | agg tok/s | decode tok/s/req | TTFT p50 s | TTFT p95 s | errors |")
    lines.append("|---|---|---|---|---|---|---|")
    for cfg in report["configs"]:
        for c, s in cfg["text"].items():
            lines.append(f"| {cfg['name']} | {c} | {fmt(s['aggregate_tok_s'])} | "
                         f"{fmt(s['decode_tok_s_per_request_mean'])} | {fmt(s['ttft_p50_s'], 3)} | "
                         f"{fmt(s['ttft_p95_s'], 3)} | {s['errors']} |")
    if any("mixed" in c for c in report["configs"]):
        lines += ["", "Mixed text+image (half the requests carry a 64x64 image):", "",
                  "| config | conc | path | requests | agg tok/s | decode tok/s/req | TTFT p50 s | errors |",
                  "|---|---|---|---|---|---|---|---|"]
        for cfg in report["configs"]:
            m = cfg.get("mixed")
            if not m:
                continue
            for path in ("text", "media"):
                s = m[path]
                lines.append(f"| {cfg['name']} | {m['concurrency']} | {path} | {s['requests']} | "
                             f"{fmt(s['aggregate_tok_s'])} | {fmt(s['decode_tok_s_per_request_mean'])} | "
                             f"{fmt(s['ttft_p50_s'], 3)} | {s['errors']} |")
    for cfg in report["configs"]:
        if cfg.get("interrupted") or cfg.get("failed"):
            lines.append(f"\n{cfg['name']}: " + (f"interrupted ({cfg['interrupted']}) after concurrency "
                                                  f"{', '.join(cfg['text']) or 'none'}" if cfg.get("interrupted")
                                                  else "failed: " + cfg["failed"].strip().splitlines()[-1][:200]))
    for cfg in report["configs"]:
        rates = {k: v for k, v in (cfg.get("mtp_acceptance") or {}).items() if k.endswith("acceptance_rate")}
        if rates:  # the plugin's own block where it has one, else the host's
            key = next((k for k in rates if k.startswith("plugins.")), next(iter(rates)))
            lines.append(f"\nMTP acceptance ({cfg['name']}, `{key}`): {rates[key]:.3f}")
    if report.get("ratios"):
        lines += ["", "Ratios plugin/host (same run):", "", "| conc | agg tok/s | decode tok/s/req | TTFT p50 |",
                  "|---|---|---|---|"]
        for c, r in report["ratios"]["text"].items():
            lines.append(f"| {c} | {fmt(r['aggregate_tok_s'], 2)} | {fmt(r['decode_tok_s_per_request'], 2)} | "
                         f"{fmt(r['ttft_p50'], 2)} |")
        if "mixed" in report["ratios"]:
            m = report["ratios"]["mixed"]
            lines.append(f"\nMixed workload aggregate tok/s ratio: all {fmt(m['all'], 2)}, "
                         f"text {fmt(m['text'], 2)}, media {fmt(m['media'], 2)}")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for cfg in report["configs"]:
        cs = [int(c) for c in cfg["text"]]
        axes[0].plot(cs, [cfg["text"][str(c)]["aggregate_tok_s"] or 0 for c in cs], marker="o", label=cfg["name"])
        axes[1].plot(cs, [cfg["text"][str(c)]["decode_tok_s_per_request_mean"] or 0 for c in cs], marker="o",
                     label=cfg["name"])
    for ax, title in zip(axes, ("aggregate decode tok/s", "decode tok/s per request")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    flags = " ".join(report["configs"][0]["flags"]) if report["configs"] else ""
    fig.suptitle(f"{Path(report['model']).name} [{flags}] — {report['device']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def resolve_model(spec: str, tmp: Path) -> Path:
    if spec == "trained":
        return TRAINED
    if spec != "tiny":
        return Path(spec)
    from support.tiny_model import build_tiny_qwen35_vlm

    out = tmp / "tiny-qwen35"
    # keep_special: False zeroes the special tokens' logits, so a random model never stops early
    build_tiny_qwen35_vlm(out, dtype="bfloat16", force=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (built now, random weights), 'trained' or a path")
    ap.add_argument("--quick", action="store_true", help="small run: concurrency 1,4, 24 tokens")
    ap.add_argument("--concurrency", default=None, help="comma-separated (default 1,2,4,8; --quick 1,4)")
    ap.add_argument("--requests-per-slot", type=float, default=2.0, help="requests per round = conc * this")
    ap.add_argument("--max-tokens", type=int, default=None, help="per request (default 96; --quick 24)")
    ap.add_argument("--no-mixed", dest="mixed", action="store_false")
    ap.add_argument("--warmup-all", action="store_true",
                    help="warm up at every concurrency too (8 tokens each), not only at 2")
    ap.add_argument("--mixed-concurrency", type=int, default=4)
    ap.add_argument("--interleave", type=int, default=0,
                    help="run both servers at once and alternate N rounds each per concurrency (text only)")
    ap.add_argument("--no-mtp", action="store_true", help="leave --enable-mtp off")
    ap.add_argument("--host-flags", default="", help="extra flags for both servers")
    ap.add_argument("--plugin-flags", default="--plugins mtp-routing",
                    help="what the plugin configuration adds (default: --plugins mtp-routing)")
    ap.add_argument("--no-plugin", action="store_true", help="benchmark the host only")
    ap.add_argument("--server-cmd", default=None,
                    help="command standing for `vllm-mlx`, e.g. 'python benchmarks/lib/vllm_mlx_launcher.py --site DIR'")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results" / "tmp",
                    help="where the JSON, Markdown and PNG go (default benchmarks/results/tmp, not tracked)")
    ap.add_argument("--name", default=None, help="output file stem (default serve_bench[_quick])")
    a = ap.parse_args(argv)
    if a.quick:
        a.requests_per_slot, a.mixed_concurrency = 1.0, 2
    a.concurrency = a.concurrency or ("1,4" if a.quick else "1,2,4,8")
    a.max_tokens = a.max_tokens or (24 if a.quick else 96)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]

    t0 = time.perf_counter()
    with contextlib.suppress(ValueError):  # only the main thread may set handlers
        signal.signal(signal.SIGTERM, _raise_interrupted)
    with tempfile.TemporaryDirectory(prefix="serve_bench.") as tmp:
        tmp = Path(tmp)
        model = resolve_model(a.model, tmp)
        base = ["--continuous-batching", "--mllm"] + ([] if a.no_mtp else ["--enable-mtp"]) + a.host_flags.split()
        configs = [("host", base)]
        if not a.no_plugin:
            configs.append(("plugin", base + a.plugin_flags.split()))
        results = []
        if a.interleave and len(configs) == 2:
            try:
                results = bench_interleaved(configs, model, a, tmp)
            except RuntimeError as e:
                results = [{"name": n, "flags": f, "failed": str(e)[-2000:], "text": {}} for n, f in configs]
            configs = []
        for name, flags in configs:
            try:
                results.append(bench_config(name, model, flags, a, tmp))
            except (RuntimeError, Interrupted) as e:
                results.append({"name": name, "flags": flags, "failed": str(e)[-2000:], "text": {}})
                print(f"[{name}] failed: {str(e)[-2000:]}", file=sys.stderr)
            if any("interrupted" in r or "signal" in r.get("failed", "") for r in results):
                break  # stopped from outside: report what was measured, start nothing new
    report = {
        "model": a.model if a.model in ("tiny", "trained") else str(model),
        "model_path": str(model),
        "device": device_line(),
        "commit": git_commit(),
        "command": "python benchmarks/serve_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "max_tokens": a.max_tokens,
        "concurrency": a.concurrency,
        "configs": results,
        "elapsed_s": time.perf_counter() - t0,
    }
    ok = [c for c in results if "failed" not in c]
    if len(ok) == 2:
        report["ratios"] = ratios(ok[0], ok[1])
    stem = a.name or ("serve_bench_quick" if a.quick else "serve_bench")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    report["plot"] = str(a.out_dir / f"{stem}.png") if plot(report, a.out_dir / f"{stem}.png") else None
    if report["plot"] is None:
        print("matplotlib not importable (pip install -e '.[bench]'): no plot written", file=sys.stderr)
    (a.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (a.out_dir / f"{stem}.md").write_text(markdown(report))
    written = [a.out_dir / f"{stem}.json", a.out_dir / f"{stem}.md"] + ([Path(report["plot"])] if report["plot"] else [])
    finish(markdown(report), written, random=random_weights(a.model, model))
    complete = len(ok) == len(results) and not any("interrupted" in c for c in ok)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
