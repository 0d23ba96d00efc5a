#!/usr/bin/env python3
"""What a long text request's preparation costs the event loop, by part, before vs after issue 13's change.

In one process, with the host's own chat-template render (vllm-mlx's BatchedEngine._apply_chat_template on
the model's mlx-vlm processor) and the model's tokenizer, for ~16K-token chats of four shapes:
- before: render, tokenize, then the prefix cache's snapshot positions (probe renders, and each boundary's
  prefix tokenized again), all on the event loop (the plugin up to 84daab4);
- after: ``prompt_preparation.prepare_chat`` (one render, one tokenization, the boundaries placed from it),
  timed alone (what it would cost on the loop) and run through ``PromptPreparer`` on its worker thread, while the loop's lag is sampled every 1 ms: the
  longest lag is what the loop still waits.
Medians of --repeats. Writes --out (JSON) and prints it.

  python benchmarks/prompt_prep_cost.py --out benchmarks/results/prompt_prep_cost-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from prefill_stall import long_prompt  # noqa: E402


def cases(text: str) -> dict[str, list[dict]]:
    system = "You are a careful assistant for a software team. " * 8
    half = len(text) // 2
    return {
        "user": [{"role": "user", "content": text}],
        "system + user": [{"role": "system", "content": system}, {"role": "user", "content": text}],
        "long system + user": [{"role": "system", "content": text}, {"role": "user", "content": "Summarize."}],
        "tool turn": [
            {"role": "system", "content": system}, {"role": "user", "content": text[:half]},
            {"role": "assistant", "content": "Reading.", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "read", "arguments": {"path": "a.py"}}}]},
            {"role": "tool", "content": text[half:], "tool_call_id": "1"},
        ],
    }


def median_ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen35-trained")
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from mlx_vlm import load
    from vllm_mlx.engine.batched import BatchedEngine

    from vllm_mlx_mtp_routing.host import engine_access as host
    from vllm_mlx_mtp_routing.prefix_cache.boundaries import snapshot_positions
    from vllm_mlx_mtp_routing.routing.prompt_preparation import PromptPreparer, prepare_chat

    engine = BatchedEngine(str(args.model), force_mllm=True)
    _, engine._processor = load(str(args.model))  # what the host's start-up sets (vllm-mlx 0.6.0)
    engine._is_mllm = True
    tok = engine._processor.tokenizer
    preparer = PromptPreparer(tok)
    text = long_prompt(args.model, args.prompt_tokens)
    results: dict = {"model": str(args.model), "host": platform.node(), "python": platform.python_version(),
                     "commit": os.environ.get("BENCH_COMMIT", ""), "cases": {}}
    for name, messages in cases(text).items():
        def render(m: list[dict]) -> str:
            return host.render_chat_prompt(engine, m, {})

        parts: dict[str, list[float]] = {k: [] for k in ("render", "tokenize", "boundaries", "boundary_renders", "boundary_tokenize")}
        after_total, after_lag, inline = [], [], []
        for _ in range(args.repeats):
            spent = {"render": 0.0, "encode": 0.0}

            def timed_render(m: list[dict]) -> str:
                t = time.perf_counter()
                out = render(m)
                spent["render"] += time.perf_counter() - t
                return out

            def timed_encode(s: str) -> list[int]:
                t = time.perf_counter()
                out = list(tok.encode(s, add_special_tokens=False))
                spent["encode"] += time.perf_counter() - t
                return out

            t0 = time.perf_counter()
            prompt = render(messages)
            t1 = time.perf_counter()
            ids = list(tok.encode(prompt, add_special_tokens=False))
            t2 = time.perf_counter()
            before_marks = snapshot_positions(timed_render, timed_encode, messages, prompt, ids)
            t3 = time.perf_counter()
            parts["render"].append(t1 - t0)
            parts["tokenize"].append(t2 - t1)
            parts["boundaries"].append(t3 - t2)
            parts["boundary_renders"].append(spent["render"])
            parts["boundary_tokenize"].append(spent["encode"])

            async def after() -> tuple[float, float, tuple]:
                lags, stop = [], asyncio.Event()

                async def sample() -> None:
                    while not stop.is_set():
                        t = time.perf_counter()
                        await asyncio.sleep(0.001)
                        lags.append(time.perf_counter() - t - 0.001)

                sampler = asyncio.create_task(sample())
                await asyncio.sleep(0.01)
                t = time.perf_counter()
                got = await preparer.chat(render, messages, positions=True)
                total = time.perf_counter() - t
                stop.set()
                await sampler
                return total, max(lags), got

            t = time.perf_counter()
            prepare_chat(tok, render, messages, positions=True)
            inline.append(time.perf_counter() - t)
            total, lag, got = asyncio.run(after())
            assert got == (ids, before_marks), f"{name}: the prepared prompt differs"
            after_total.append(total)
            after_lag.append(lag)
        before_ms = {k: median_ms(v) for k, v in parts.items()}
        before_ms["event_loop_total"] = round(before_ms["render"] + before_ms["tokenize"] + before_ms["boundaries"], 2)
        results["cases"][name] = {
            "prompt_tokens": len(ids), "positions": before_marks, "before_ms": before_ms,
            "after_ms": {"one_tokenization_inline": median_ms(inline), "worker_total": median_ms(after_total),
                         "event_loop_longest_lag": median_ms(after_lag)},
        }
        print(name, json.dumps(results["cases"][name]), flush=True)
    preparer.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
