#!/usr/bin/env python3
"""Agentic multi-turn benchmark: prefix reuse on a shared system + tools prompt, three servers at once.

Servers, all up at the same time on 127.0.0.1, same model:
    host     vllm-mlx serve MODEL --continuous-batching --mllm                 (the host alone)
    mlx-lm   python -m mlx_lm.server --model MODEL                             (mlx-lm 0.32.x, its own venv)
    plugin   vllm-mlx serve MODEL --continuous-batching --mllm --plugins mtp-routing

Workload: C concurrent conversations of T turns sharing one long system prompt with tool
definitions; turn 1 is a user question, each later turn adds a scripted assistant reply and then,
alternately, a tool result or a user message (the prompts are the same on every server: replies
are scripted, the generated text is discarded). Turn t of the C conversations is sent to one
server at a time (all C at once, streaming, temperature 0), the servers in a rotating order, so no
two servers compete for the CPU and a slow phase of the machine spreads over all of them.

Per server, turn and conversation: prompt tokens, tokens reused (usage.prompt_tokens_details.
cached_tokens; the plugin's and mlx-lm's), tokens actually prefilled, tokens new since the
conversation's previous turn, TTFT. Ratios are TTFT against the host alone in the same run.

  python benchmarks/agentic_bench.py                      # 3 x 8 turns, ~4K-token prefix
  python benchmarks/agentic_bench.py --quick              # small, for tests
  python benchmarks/agentic_bench.py --mlx-lm-python /tmp/mlxlm-venv/bin/python
It prints the table and the files it wrote (--out: the JSON and a Markdown table beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*
from vllm_mlx_mtp_routing.prefix_cache.boundaries import common_tokens  # noqa: E402
from support import server as testing_server  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from lib import provenance  # noqa: E402
from lib.report import finish, random_weights  # noqa: E402

TRAINED = REPO / "models" / "tiny-qwen35-trained"

TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {p: {"type": "string", "description": f"the {p}"} for p in params},
        "required": list(params)}}}
    for name, desc, params in [
        ("read_file", "Read a file of the repository and return its text.", ["path"]),
        ("list_dir", "List the entries of a directory.", ["path"]),
        ("grep", "Search the repository for a regular expression.", ["pattern", "path"]),
        ("run_tests", "Run the test suite, or one test file, and return the report.", ["target"]),
        ("edit_file", "Replace a span of a file with new text.", ["path", "old", "new"]),
    ]
]

RULES = [
    "Read the relevant files before you answer; never guess an API that you have not seen.",
    "Keep every change minimal and explain it in one sentence.",
    "Run the tests that cover a change before you report it done.",
    "Cite files by their path relative to the repository root.",
    "Ask before deleting files or rewriting history.",
    "Prefer the standard library; add a dependency only when asked.",
    "When a test fails, read its output fully before changing code.",
    "Say so plainly when you do not know.",
]

CODE = '''def parse_header(line):
    """Parse a Content-type like header. Return the main content-type and a dict of options."""
    parts = _parseparam(";" + line)
    key = parts.__next__()
    pdict = {}
    for p in parts:
        i = p.find("=")
        if i >= 0:
            name = p[:i].strip().lower()
            value = p[i + 1 :].strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1].replace("\\\\\\\\", "\\\\").replace('\\\\"', '"')
            pdict[name] = value
    return key, pdict
'''


def system_prompt(target_tokens: int, tokenizer) -> str:
    """A coding agent's system prompt: rules, then repository notes, about target_tokens long
    (the system + tools block as the chat template renders it)."""
    head = "You are a coding agent working in a Python repository for a small team.\n" + "\n".join(
        f"{i + 1}. {r}" for i, r in enumerate(RULES))
    notes: list[str] = []
    while len(render_ids(tokenizer, [{"role": "system", "content": head + "".join(notes)},
                                     {"role": "user", "content": "?"}])) < target_tokens:
        i = len(notes)
        notes.append(f"\n\n# Repository note {i + 1}: module src/pkg/mod{i}.py\n{CODE.replace('parse_header', f'parse_header_{i}')}")
    return head + "".join(notes)


def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=[t["function"] for t in TOOLS], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def tool_result(conv: int, turn: int) -> str:
    return f"src/pkg/mod{conv}_{turn}.py:\n" + CODE.replace("parse_header", f"parse_{conv}_{turn}") * 2


def user_message(conv: int, turn: int) -> str:
    return f"Conversation {conv}, step {turn}: now check how parse_{conv}_{turn} handles quoted values and fix it if needed."


def assistant_reply(conv: int, turn: int) -> str:
    return f"I read the file for step {turn} of task {conv}. The quoted-value branch looks suspicious; next I will look at the caller."


def short_reply(conv: int, turn: int) -> str:
    return f"Step {turn} of task {conv} is done."


def short_question(conv: int, turn: int) -> str:
    return f"Good. For step {turn} of task {conv}, is the quoted-value branch of parse_header covered by a test?"


def conversation_turns(conv: int, turns: int, system: str, short: bool = False) -> list[list[dict]]:
    """The message list sent at each turn of one conversation; ``short``: each later turn adds a one-line reply and a
    one-line user message (about 50 tokens with the generation prompt), a follow-up question in a chat."""
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Task {conv}: find where headers are parsed and make parse_header strict."}]
    out = [list(messages)]
    for t in range(2, turns + 1):
        if short:
            messages += [{"role": "assistant", "content": short_reply(conv, t)},
                         {"role": "user", "content": short_question(conv, t)}]
            out.append(list(messages))
            continue
        messages.append({"role": "assistant", "content": assistant_reply(conv, t)})
        if t % 2 == 0:
            messages.append({"role": "tool", "tool_call_id": f"call_{conv}_{t}", "content": tool_result(conv, t)})
        else:
            messages.append({"role": "user", "content": user_message(conv, t)})
        out.append(list(messages))
    return out


# ---------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def mlx_lm_server(python: str, model: Path, log_dir: Path, timeout: float = 300.0) -> Iterator[testing_server.Server]:
    port = testing_server.free_port()
    cmd = [python, "-m", "mlx_lm.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    with testing_server.run_server(cmd, port, model=str(model), log_path=log_dir / f"mlx-lm-{port}.log", env=env,
                                   ready_path="/v1/models", startup_timeout=timeout) as srv:
        yield srv


# ---------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------


async def one_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage, error = None, None, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk.get("choices") or ():
                    d = ch.get("delta") or {}
                    if ttft is None and any(d.get(k) for k in ("content", "reasoning", "reasoning_content", "tool_calls")):
                        ttft = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    total = time.perf_counter() - t0
    # A first token may decode to no visible text (a newline, half a character): then the end of
    # the stream stands for it, which with max_tokens 1 is the same moment.
    out = {"ttft_s": ttft if ttft is not None else total, "total_s": total, "error": error}
    if usage:
        out["prompt_tokens"] = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        out["cached_tokens"] = int(details.get("cached_tokens") or 0)
    return out


async def run_turn(url: str, model: str, convs: list[list[list[dict]]], t: int, max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        return list(await asyncio.gather(*(one_turn(client, url, model, c[t], max_tokens) for c in convs)))


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------


def summarize(results: dict[str, list[list[dict]]], turns: int, changed: list[list[int]] | None = None) -> dict:
    """Per server and turn: mean TTFT, prompt / reused / prefilled / new tokens; TTFT ratios vs the host."""
    out: dict = {}
    for name, per_turn in results.items():
        rows = []
        for t, recs in enumerate(per_turn):
            ok = [r for r in recs if not r.get("error")]
            row = {"turn": t + 1, "ttft_s": [round(r["ttft_s"], 3) for r in recs],
                   "ttft_mean_s": round(statistics.fmean(r["ttft_s"] for r in ok), 3) if ok else None,
                   "errors": len(recs) - len(ok)}
            if recs and all("server_cpu_s" in r for r in recs):
                row["server_cpu_s"] = round(sum(r["server_cpu_s"] for r in recs), 3)
            if ok and all("prompt_tokens" in r for r in ok):
                row["prompt_tokens"] = [r["prompt_tokens"] for r in ok]
                row["cached_tokens"] = [r.get("cached_tokens", 0) for r in ok]
                row["prefilled_tokens"] = [r["prompt_tokens"] - r.get("cached_tokens", 0) for r in ok]
                if t > 0:
                    prev = per_turn[t - 1]
                    row["new_tokens"] = [r["prompt_tokens"] - p.get("prompt_tokens", 0) for r, p in zip(ok, prev)]
                    if changed is not None:
                        # tokens from the first one that differs from the previous turn's prompt (the
                        # template re-renders earlier assistant turns once a user message follows)
                        row["changed_tokens"] = changed[t]
                        row["prefilled_vs_changed"] = [round(p / c, 3) if c else None
                                                       for p, c in zip(row["prefilled_tokens"], changed[t])]
            rows.append(row)
        out[name] = rows
    if "host" in out:
        for name, rows in out.items():
            for row, hrow in zip(rows, out["host"]):
                if row["ttft_mean_s"] and hrow["ttft_mean_s"]:
                    row["ttft_vs_host"] = round(row["ttft_mean_s"] / hrow["ttft_mean_s"], 3)
    for name in [n for n in out if n.startswith("plugin") and "mlx-lm" in out]:
        for row, prow in zip(out[name], out["mlx-lm"]):
            if row["ttft_mean_s"] and prow["ttft_mean_s"]:
                row["ttft_vs_mlx_lm"] = round(row["ttft_mean_s"] / prow["ttft_mean_s"], 3)
            if row.get("server_cpu_s") and prow.get("server_cpu_s"):
                row["cpu_vs_mlx_lm"] = round(row["server_cpu_s"] / prow["server_cpu_s"], 3)
    return out


def later_turn_ratios(summary: dict) -> dict:
    """Per plugin server: its TTFT over mlx-lm's on turns 2 on (each a pair from the same run), their spread and how
    many are at most 1.0; the same for the servers' CPU seconds."""
    out = {}
    for name, rows in summary.items():
        ratios = [r["ttft_vs_mlx_lm"] for r in rows[1:] if r.get("ttft_vs_mlx_lm")]
        cpu = [r["cpu_vs_mlx_lm"] for r in rows[1:] if r.get("cpu_vs_mlx_lm")]
        if ratios:
            out[name] = {"ttft_ratios": ratios, "min": min(ratios), "mean": round(statistics.fmean(ratios), 3),
                         "median": round(statistics.median(ratios), 3), "max": max(ratios),
                         "at_most_1": sum(r <= 1.0 for r in ratios), "turns": len(ratios),
                         **({"cpu_mean": round(statistics.fmean(cpu), 3)} if cpu else {})}
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a server process so far, all its threads (a turn's cost where other work shares
    the machine and the wall clock measures its load as much as the server)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prefill_clock(model_path: Path, ids: list[int], chunk: int, repeats: int = 2) -> list[float]:
    """Seconds to prefill ``ids[:p]`` for every p, from one pass in ``chunk``-token forwards (the server's
    chunking: cut at multiples of ``chunk`` from the start) on the plugin's own text model, in this
    process (the servers stopped). A token's cost grows with its position (attention), so a suffix
    after a hit costs more per token than the prompt's average: this clock prices it where it sits.
    The fastest of ``repeats`` passes per chunk."""
    import mlx.core as mx
    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    vlm, _ = load(str(model_path))
    model = build_text_model(vlm, model_path, json.loads((model_path / "config.json").read_text())).model
    model.train(False)
    best = [float("inf")] * (-(-len(ids) // chunk))
    for _ in range(repeats):
        cache = model.make_cache()
        for i in range(len(best)):
            part = mx.array(ids[i * chunk:(i + 1) * chunk], dtype=mx.uint32)[None]
            tic = time.perf_counter()
            model(part, cache=cache)  # as the engine prefills: the caches evaluated, the logits never
            mx.eval([c.state for c in cache])
            best[i] = min(best[i], time.perf_counter() - tic)
    clock = [0.0]  # clock[p]: ids[:p]; within a chunk its time is spread evenly over its tokens
    for i, sec in enumerate(best):
        n = min(chunk, len(ids) - i * chunk)
        start = clock[-1]
        clock += [start + sec * (j + 1) / n for j in range(n)]
    return clock


def ideal_vs_ttft(summary: dict, clock: list[float]) -> list[dict]:
    """Per turn from 2 on, the plugin's first-served conversation against the ideal: its suffix's prefill time at
    its positions (``clock``), and the full prompt's; ``ttft_vs_ideal`` = suffix time / TTFT (1.0: the hit costs
    nothing beyond the suffix's prefill)."""
    out = []
    for row in summary.get("plugin", [])[1:]:
        if "cached_tokens" not in row:
            continue
        i = min(range(len(row["ttft_s"])), key=lambda j: row["ttft_s"][j])
        prompt, cached = row["prompt_tokens"][i], row["cached_tokens"][i]
        if prompt - 1 >= len(clock):
            continue
        full, suffix = clock[prompt - 1], clock[prompt - 1] - clock[cached]
        out.append({"turn": row["turn"], "prompt_tokens": prompt, "cached_tokens": cached,
                    "full_prefill_s": round(full, 3), "suffix_prefill_s": round(suffix, 3),
                    "ideal_speedup": round(full / suffix, 2) if suffix else None,
                    "first_ttft_s": row["ttft_s"][i], "ttft_vs_ideal": round(suffix / row["ttft_s"][i], 3)})
    return out


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"Agentic benchmark: {meta['conversations']} conversations x {meta['turns']} turns, shared prefix "
             f"~{meta['system_tokens']} tokens, max_tokens {meta['max_tokens']}; {meta['device']}", "",
             "| turn | kind | server | TTFT mean s | vs host | plugin vs mlx-lm | prompt tok | reused | prefilled | appended since prev | changed since prev |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in range(meta["turns"]):
        kind = "first" if t == 0 else ("user message" if meta.get("short_turns") or (t + 1) % 2 else "tool result")
        for name, rows in summary.items():
            r = rows[t]
            lines.append(f"| {t + 1} | {kind} | {name} | {r['ttft_mean_s']} | {r.get('ttft_vs_host', '')} | "
                         f"{r.get('ttft_vs_mlx_lm', '')} | {r.get('prompt_tokens', '')} | {r.get('cached_tokens', '')} | "
                         f"{r.get('prefilled_tokens', '')} | {r.get('new_tokens', '')} | {r.get('changed_tokens', '')} |")
    return "\n".join(lines)


def _raise_interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so the servers are stopped on the way out


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _raise_interrupted)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(TRAINED))
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=1,
                    help="1 (default): TTFT is the time to the one token, whatever text it decodes to")
    ap.add_argument("--servers", default="host,mlx-lm,plugin")
    ap.add_argument("--mlx-lm-python", default="/tmp/mlxlm-venv/bin/python")
    ap.add_argument("--plugin-flags", default="", help="extra flags for the plugin server")
    ap.add_argument("--base-plugin", default=None, metavar="DIR",
                    help="server 'plugin-base' (name it in --servers): the plugin imported from another checkout (DIR, "
                         "e.g. a git worktree of main) through PYTHONPATH, to compare two commits in one run")
    ap.add_argument("--quick", action="store_true", help="2 conversations x 3 turns, ~600-token prefix")
    ap.add_argument("--short-turns", action="store_true",
                    help="each later turn adds a one-line reply and a one-line question (~50 new tokens), not a tool result "
                         "or a paragraph")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--ideal", action="store_true",
                    help="after the servers stop: time the plugin's prefill of the longest prompt in-process, chunk by chunk, "
                         "and report each turn's first-served TTFT against its suffix's prefill time (summary: ideal)")
    ap.add_argument("--server-cmd", default=None,
                    help="replaces the vllm-mlx console script, e.g. 'python benchmarks/lib/vllm_mlx_launcher.py --site DIR'")
    a = ap.parse_args(argv)
    if a.quick:
        a.conversations, a.turns, a.system_tokens = 2, 3, 600
    servers = [s for s in a.servers.split(",") if s]
    model = Path(a.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    system = system_prompt(a.system_tokens, tokenizer)
    convs = [conversation_turns(c, a.turns, system, a.short_turns) for c in range(a.conversations)]
    ids = [[render_ids(tokenizer, m) for m in c] for c in convs]
    changed = [[len(c[t]) - (common_tokens(c[t], c[t - 1]) if t else 0) for c in ids] for t in range(a.turns)]
    log_dir = Path(tempfile.mkdtemp(prefix="agentic-bench-"))
    base = ["--continuous-batching", "--mllm"]
    results: dict[str, list[list[dict]]] = {s: [] for s in servers}
    statuses: dict[str, dict] = {}
    cmd = shlex.split(a.server_cmd) if a.server_cmd else None
    interrupted = False
    with contextlib.ExitStack() as stack:
        urls: dict[str, tuple[str, str]] = {}
        pids: dict[str, int] = {}
        for s in servers:
            if s == "host":
                srv = stack.enter_context(testing_server.serve(model, *base, log_dir=log_dir, startup_timeout=300,
                                                               command=cmd))
                urls[s], pids[s] = (srv.url, srv.model), srv.proc.pid
            elif s == "plugin":
                flags = [*base, "--plugins", "mtp-routing", *a.plugin_flags.split()]
                srv = stack.enter_context(testing_server.serve(model, *flags, log_dir=log_dir, startup_timeout=300,
                                                               command=cmd))
                urls[s], pids[s] = (srv.url, srv.model), srv.proc.pid
            elif s == "plugin-base":
                if not a.base_plugin:
                    raise SystemExit("server 'plugin-base' needs --base-plugin DIR")
                flags = [*base, "--plugins", "mtp-routing", *a.plugin_flags.split()]
                srv = stack.enter_context(testing_server.serve(model, *flags, log_dir=log_dir, startup_timeout=300,
                                                               command=cmd, env={"PYTHONPATH": a.base_plugin}))
                urls[s], pids[s] = (srv.url, srv.model), srv.proc.pid
            elif s == "mlx-lm":
                srv = stack.enter_context(mlx_lm_server(a.mlx_lm_python, model, log_dir))
                urls[s], pids[s] = (srv.url, str(model)), srv.proc.pid
            else:
                raise SystemExit(f"unknown server {s!r}")
        try:
            for t in range(a.turns):
                order = servers[t % len(servers):] + servers[: t % len(servers)]
                for s in order:
                    url, name = urls[s]
                    cpu0 = cpu_seconds(pids[s])
                    recs = asyncio.run(run_turn(url, name, convs, t, a.max_tokens))
                    cpu = cpu_seconds(pids[s]) - cpu0
                    for r in recs:  # the server's CPU seconds over the turn, shared by its requests
                        r["server_cpu_s"] = cpu / len(recs)
                    results[s].append(recs)
                    print(f"turn {t + 1} {s}: ttft {[round(r['ttft_s'], 2) for r in recs]} "
                          f"cached {[r.get('cached_tokens') for r in recs]} "
                          f"errors {[r['error'] for r in recs if r.get('error')]}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # a time limit: keep the turns every server finished
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the rest is quick: servers stop, results written
            interrupted = True
            done = min(len(v) for v in results.values())
            results = {k: v[:done] for k, v in results.items()}
            a.turns = done
        if "plugin" in urls and not interrupted:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):  # gone after a time limit
                status = httpx.get(f"{urls['plugin'][0]}/v1/status", timeout=30).json()
                statuses["plugin"] = status["plugins"]["mtp-routing"].get("prefix_cache", {})
                statuses["plugin_prefill"] = status["plugins"]["mtp-routing"].get("prefill") or {}
    summary = summarize(results, a.turns, changed)
    if a.ideal and "plugin" in summary:
        chunk = int(statuses.get("plugin_prefill", {}).get("chunk_tokens") or 2048)
        longest = max(ids[0], key=len)  # + a few tokens: the server's prompt also holds the generation prompt
        clock = prefill_clock(model, longest + longest[-64:], chunk)
        ideal = {"chunk_tokens": chunk, "turns": ideal_vs_ttft(summary, clock)}
        print("ideal:", json.dumps(ideal), file=sys.stderr, flush=True)
    else:
        ideal = None
    meta = {"conversations": a.conversations, "turns": a.turns, "system_tokens": a.system_tokens, "short_turns": a.short_turns,
            "max_tokens": a.max_tokens, "device": provenance.device_line(), "model": str(model), "servers": servers,
            "commit": provenance.commit(), "interrupted": interrupted}
    later = later_turn_ratios(summary)
    if later:
        print("later turns vs mlx-lm:", json.dumps(later), file=sys.stderr, flush=True)
    report = {"meta": meta, "summary": summary, "later_turns_vs_mlx_lm": later, "plugin_prefix_cache": statuses.get("plugin"), "raw": results,
              **({"ideal": ideal} if ideal else {})}
    files = []
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
        Path(a.out).with_suffix(".md").write_text(markdown(summary, meta) + "\n")
        files = [Path(a.out), Path(a.out).with_suffix(".md")]
    finish(markdown(summary, meta), files, random=random_weights("", model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
