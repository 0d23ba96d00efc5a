#!/usr/bin/env python3
"""Stall benchmark: running streams and /health while a long prompt prefills, before vs after.

Through the real `vllm-mlx serve --plugins mtp-routing` on loopback. N streams decode; once each has
produced a few tokens, one request with a P-token prompt arrives (max_tokens 1) while /health is
polled every 50 ms. Reported per server: the median inter-token gap of the streams before the long
prompt arrived (the decode cadence), the longest gap while it prefilled, /health's worst and median
latency over that window, and the long prompt's time to its answer (TTFT). "before" runs the plugin
from another checkout (`--base DIR`, put first on PYTHONPATH), "after" this checkout; both in one run,
same model and flags. Target (issue 13): longest gap <= 3x the median decode gap plus one step's
prefill budget; /health under 1 s.

``--prep-probes N``: then, with both servers up, N rounds alternating between them: the streams run while a
long prompt arrives with max_tokens past the model's context, so the server prepares it (chat template,
tokenization, snapshot positions) and answers 400 before any prefill (under ``--strict-max-tokens``, which the
probes' servers get: without it an overflowing max_tokens is cut to the context); the streams' longest gap overlapping
the request is what the preparation costs them (``prep_probes`` in the JSON). ``--skip-prefill``: probes only.

  python benchmarks/prefill_stall.py --base /path/to/baseline-checkout
  python benchmarks/prefill_stall.py --model /root/qwen35-2b --prompt-tokens 16384   # on a GPU

Writes benchmarks/results/prefill_stall-<device>.json (or --out) and prints a JSON summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
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


async def measure(url: str, model: str, prompt: str, streams: int, warm_tokens: int, timeout: float,
                  extra: dict | None = None, max_tokens: int = 1, expect: int = 200, after_frames: int = 0) -> dict:
    """``extra``: fields added to the long prompt's request body (e.g. ``specprefill``); ``expect``: its status.
    ``after_frames``: the streams go on for this many frames after the answer, for their cadence at the depth the
    prefill left them at (``depth``)."""
    # A stream's frames, one per engine step that gave it tokens. A token that releases no text on its
    # own (a byte of an unfinished UTF-8 character: ~2% of a random-weight model's tokens) comes in a
    # frame without content, so gaps between content frames alone ("text" gaps) can span two steps.
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    text_arrivals: list[list[float]] = [[] for _ in range(streams)]
    stop = asyncio.Event()

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": f"def worker_{i}(queue):"}],
                "max_tokens": 8000, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                    now = time.perf_counter()
                    arrivals[i].append(now)
                    if '"content"' in line:
                        text_arrivals[i].append(now)
                if stop.is_set():
                    return

    health: list[tuple[float, float]] = []
    answered = asyncio.Event()

    async def poll_health(client: httpx.AsyncClient) -> None:
        while not answered.is_set():
            tic = time.perf_counter()
            await client.get("/health")
            health.append((tic, time.perf_counter() - tic))
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        tasks = [asyncio.create_task(stream(client, i)) for i in range(streams)]
        t_wait = time.perf_counter()
        while min(len(a) for a in arrivals) < warm_tokens:
            await asyncio.sleep(0.01)
            if time.perf_counter() - t_wait > timeout:
                raise RuntimeError("streams did not start")
        poller = asyncio.create_task(poll_health(client))
        t0 = time.perf_counter()
        response = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, **(extra or {})})
        t1 = time.perf_counter()
        answered.set()
        await poller
        t_after = time.perf_counter() + 0.5  # past the long row's leaving (and its snapshot, if cached)
        while after_frames and time.perf_counter() - t1 < timeout and any(not t.done() for t in tasks) and min(
                sum(x >= t_after for x in arr) for arr, t in zip(arrivals, tasks) if not t.done()) < after_frames:
            await asyncio.sleep(0.05)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if response.status_code != expect:
        raise RuntimeError(f"long prompt: HTTP {response.status_code}: {response.text[:300]}")
    before = [b - a for arr in arrivals for a, b in zip(arr, arr[1:]) if b < t0]
    # a gap counts for the window when it ends inside it (the token that had to wait for the prefill)
    during = [b - a for arr in arrivals for a, b in zip(arr, arr[1:]) if t0 <= b <= t1 + 0.5]
    # when the worst gaps ended, from the long prompt's send: early = admission/first chunk, late = the row's join
    worst = sorted(((b - a, b - t0) for arr in arrivals for a, b in zip(arr, arr[1:]) if t0 <= b <= t1 + 0.5), reverse=True)
    starved = [t1 - arr[-1] for arr in arrivals if arr and arr[-1] < t1]  # streams with no token after a stall
    overlapping = [b - a for arr in arrivals for a, b in zip(arr, arr[1:]) if b > t0 and a < t1]
    lat = [d for tic, d in health if t0 <= tic <= t1]
    text_during = [b - a for arr in text_arrivals for a, b in zip(arr, arr[1:]) if t0 <= b <= t1 + 0.5]
    # the engine's own account of its slowest recent steps (a window of 256 steps: warm the streams past it,
    # --warm-tokens, so that only this round's steps are in it)
    status = httpx.get(f"{url}/v1/status", timeout=30).json().get("plugins", {}).get("mtp-routing", {})
    slowest = (status.get("text_engine") or {}).get("slowest_steps")
    depth = depth_targets(arrivals, t0, t1, statistics.median(before), after_frames)
    return {
        **({"depth": depth} if depth else {}),
        "prompt_tokens": response.json()["usage"]["prompt_tokens"] if expect == 200 else None,
        "ttft_s": round(t1 - t0, 3),
        "decode_gap_median_s": round(statistics.median(before), 4),
        "longest_gap_s": round(max(during + starved), 4),
        "window_gap_s": round(max(overlapping + starved), 4),  # gaps overlapping the request, from its send to its answer
        "gap_p99_s": round(sorted(during)[int(0.99 * (len(during) - 1))], 4) if during else None,
        "gaps_during_prefill": len(during),
        "longest_text_gap_s": round(max(text_during), 4) if text_during else None,  # content frames only (see above)
        "health_max_s": round(max(lat), 4) if lat else None,
        "health_median_s": round(statistics.median(lat), 4) if lat else None,
        "health_polls": len(lat),
        "worst_gaps_s_at_s": [(round(g, 3), round(at, 3)) for g, at in worst[:4]],
        **({"slowest_steps": slowest} if slowest is not None else {}),
    }


def depth_targets(arrivals: list[list[float]], t0: float, t1: float, cadence_before: float, after_frames: int) -> dict:
    """The decode cadence the prefill's gaps are judged against, at the depth each gap was at.

    The streams grow while a long prompt prefills (on a CPU, by thousands of tokens over minutes), and so does their
    own decode step: the cadence before the prompt arrived understates what a step costs by the prefill's end. The
    streams' cadence after the prompt's answer (its row gone) is the cadence at the depth they reached; a gap's
    cadence is interpolated between the two by the stream's frame index (its depth). Per gap: ``c`` at its depth,
    to be judged against 3 c plus the engine's step budget at that cadence (see main)."""
    if not after_frames:
        return {}
    t_after = t1 + 0.5
    after = [b - a for arr in arrivals for a, b in zip(arr, arr[1:]) if a >= t_after]
    if len(after) < 3:
        return {}
    cadence_after = statistics.median(after)
    gaps = []  # (gap, cadence at its depth)
    for arr in arrivals:
        j0, j1 = sum(x < t0 for x in arr), sum(x <= t1 + 0.5 for x in arr)
        for j in range(max(j0, 1), j1):
            frac = (j - j0) / max(1, j1 - j0)
            gaps.append((arr[j] - arr[j - 1], cadence_before + frac * (cadence_after - cadence_before)))
    return {"decode_gap_after_s": round(cadence_after, 4), "gaps": gaps}


def judge_at_depth(depth: dict, prefill: dict) -> dict:
    """Each gap against 3x the cadence at its depth plus the engine's step budget at that cadence: ``ratio`` of the
    running batch's decode steps, at least one chunk's limit (prefill_budget.py). The worst gap by that ratio."""
    ratio, limit = prefill["ratio"], prefill.get("chunk_limit_s") or 0.0
    worst = max(depth.pop("gaps"), key=lambda g: g[0] / (3 * g[1] + max(ratio * g[1], limit)))
    gap, c = worst
    target = 3 * c + max(ratio * c, limit)
    return {**depth, "worst_gap_s": round(gap, 4), "its_cadence_s": round(c, 4), "its_target_s": round(target, 4),
            "worst_over_target": round(gap / target, 3)}


def model_context(model: Path) -> int:
    """The context the plugin reads (text_config first); the probes need one, or a probe would generate."""
    config = json.loads((model / "config.json").read_text())
    for source in (config.get("text_config") or {}, config):
        if isinstance(source.get("max_position_embeddings"), int):
            return source["max_position_embeddings"]
    raise SystemExit(f"{model}: no max_position_embeddings in config.json")


def prep_probes(servers: dict, prompt: str, args: argparse.Namespace, context: int) -> dict:
    """Rounds alternating between the servers: a long prompt answered 400 after its preparation, no prefill; and
    the same with a one-line prompt (control: the longest gap of a request that costs the loop nothing)."""
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    controls: dict[str, list[dict]] = {name: [] for name in servers}
    for k in range(args.prep_probes):
        for name, server in servers.items():
            for text, into in ((f"probe {k} {name}: {prompt}", runs), (f"probe {k} {name}: one line", controls)):
                into[name].append(asyncio.run(measure(server.url, server.model, text, args.streams, args.warm_tokens,
                                                      args.timeout, max_tokens=context, expect=400)))
    out = {}
    for name, rs in runs.items():
        gaps, decode = [r["window_gap_s"] for r in rs], [r["decode_gap_median_s"] for r in rs]
        control = [r["window_gap_s"] for r in controls[name]]
        health = [r["health_max_s"] for r in rs if r["health_max_s"] is not None]
        out[name] = {
            "probes": len(rs), "answer_s_median": round(statistics.median(r["ttft_s"] for r in rs), 4),
            "decode_gap_median_s": round(statistics.median(decode), 4),
            "window_gap_median_s": round(statistics.median(gaps), 4), "window_gap_max_s": round(max(gaps), 4),
            "control_window_gap_median_s": round(statistics.median(control), 4),
            "health_max_s": round(max(health), 4) if health else None, "runs": rs,
        }
    return out


def strict_flag_known(checkout: Path) -> bool:
    """Does this checkout's plugin have --strict-max-tokens (older ones refused an overflowing max_tokens anyway)?"""
    config = checkout / "vllm_mlx_mtp_routing" / "config.py"
    return config.exists() and "--strict-max-tokens" in config.read_text()


def plugin_prefill_stats(url: str) -> dict | None:
    return httpx.get(f"{url}/v1/status", timeout=30).json()["plugins"]["mtp-routing"].get("prefill")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--base", type=Path, help="baseline checkout (its plugin runs as 'before'); omitted: after only")
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--warm-tokens", type=int, default=8)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--flags", default="", help="extra serve flags for both servers")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--command", default="", help="replaces the vllm-mlx console script (e.g. a launcher)")
    ap.add_argument("--rounds", type=int, default=1, help="long prompts per server, each new to its prefix cache")
    ap.add_argument("--prep-probes", type=int, default=0, help="preparation-only rounds per server, alternating (see above)")
    ap.add_argument("--skip-prefill", action="store_true", help="only the preparation probes")
    ap.add_argument("--fresh-ptx-cache", action="store_true",
                    help="MLX's CUDA kernel cache: an empty folder per server (a first prompt's compiles are its own)")
    ap.add_argument("--after-frames", type=int, default=24,
                    help="frames per stream after the answer: their cadence at the depth reached (0: not measured)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import mlx.core as mx

    device = str(mx.default_device())
    prompt = long_prompt(args.model, args.prompt_tokens)
    context = model_context(args.model) if args.prep_probes else 0  # a probe asks for this many tokens
    flags = ["--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", str(args.streams + 2),
             "--prefill-step-size", str(args.prefill_step_size), *args.flags.split()]
    if context > 32768:  # the host's --max-request-tokens default
        flags += ["--max-request-tokens", str(context)]
    command = args.command.split() if args.command else None
    variants = ([("before", {"PYTHONPATH": os.pathsep.join(filter(None, [str(args.base), os.environ.get("PYTHONPATH", "")]))})]
                if args.base else []) + [("after", {})]
    strict = {name: bool(args.prep_probes) and strict_flag_known(args.base if name == "before" else REPO) for name, _ in variants}
    if args.fresh_ptx_cache:  # each server compiles its own CUDA kernels: neither starts on what the other compiled
        import tempfile

        ptx_root = Path(tempfile.mkdtemp(prefix="prefill_stall_ptx-"))
        variants = [(name, {**env, "MLX_PTX_CACHE_DIR": str(ptx_root / name)}) for name, env in variants]
    results: dict = {"device": device, "host": platform.node(), "model": str(args.model), "flags": flags,
                     "streams": args.streams, "commit": os.environ.get("BENCH_COMMIT", "")}
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "prefill_stall_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:  # the servers are up together; one at a time is measured
        servers = {name: stack.enter_context(serve(args.model, *flags, *(["--strict-max-tokens"] if strict[name] else []),
                                                   log_dir=log_dir, env=env, command=command, startup_timeout=args.timeout))
                   for name, env in variants}
        for server in servers.values():
            httpx.post(f"{server.url}/v1/chat/completions", timeout=args.timeout, json={
                "model": server.model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})
        for name, server in servers.items():
            if args.skip_prefill:
                break
            rounds = [asyncio.run(measure(server.url, server.model, f"round {k}: {prompt}", args.streams, args.warm_tokens,
                                          args.timeout, after_frames=args.after_frames)) for k in range(args.rounds)]
            r = rounds[0]
            if args.rounds > 1:
                r["later_rounds"] = rounds[1:]
            r["prefill"] = plugin_prefill_stats(server.url)
            budget = (r["prefill"] or {}).get("target_s") or 0.0
            r["target_gap_s"] = round(3 * r["decode_gap_median_s"] + budget, 4) if r["prefill"] else None
            # The budget the engine holds a step's prefill to: `ratio` of the running batch's decode steps (the
            # median gap here; target_s above is `ratio` one-row steps timed at start), and at least one chunk,
            # projected within chunk_limit_s (reported since chunks shrink with the position).
            p = r["prefill"] or {}
            if p.get("chunk_limit_s"):
                step_budget = max(p["ratio"] * r["decode_gap_median_s"], p["chunk_limit_s"])
                r["target_gap_engine_s"] = round(3 * r["decode_gap_median_s"] + step_budget, 4)
            for rr in [r, *r.get("later_rounds", [])]:
                if "depth" in rr and p.get("ratio"):
                    rr["depth"] = judge_at_depth(rr["depth"], p)
                else:
                    rr.pop("depth", None)
            r["gap_over_decode"] = round(r["longest_gap_s"] / r["decode_gap_median_s"], 1)
            results[name] = r
            print(name, json.dumps(r), flush=True)
        if args.prep_probes:
            results["prep_probes"] = prep_probes(servers, prompt, args, context)
            print("prep_probes", json.dumps(results["prep_probes"]), flush=True)
    kind = "gpu" if mx.default_device() == mx.gpu else "cpu"
    out = args.out or REPO / "benchmarks" / "results" / f"prefill_stall-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
