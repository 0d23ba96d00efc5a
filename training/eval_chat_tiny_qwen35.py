#!/usr/bin/env python3
"""Does a tiny checkpoint end its chat replies? Greedy replies as the server decodes them, and MTP acceptance.

Loads the checkpoint as eval_tiny_qwen35 does (mlx_vlm.load + vllm_mlx build_text_model + inject_mtp_support, bf16
as served), renders prompts with the checkpoint's own chat template and decodes greedily up to --max-new tokens,
stopping at <|im_end|> / <|endoftext|>:
  short     conversations from training/chat_samples.py built from held-out stdlib files (a seed of their own)
  replays   the agents' recorded first requests (tests/data/agent_replays.json), messages normalized as the server
            does (developer -> system, system messages first and merged, content blocks joined)
  long      agent-like first requests of --long-tokens tokens: a recorded request's system text, tools and user
            message, grown with held-out prose and tool definitions
A reply "ends" when <|im_end|> comes within --max-new tokens. Then eval_tiny_qwen35's MTP measures on held-out code.

  python training/eval_chat_tiny_qwen35.py models/tiny-qwen35-trained --out /tmp/eval_chat.json
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_tiny_qwen35 import greedy_acceptance, heldout_tokens, load_served, teacher_forced

REPLAYS = Path(__file__).resolve().parents[1] / "tests" / "data" / "agent_replays.json"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") for b in content or [] if isinstance(b, dict))


def _tool(t: dict[str, Any]) -> dict[str, Any]:
    if "function" in t:
        return t
    return {"type": "function", "function": {"name": t.get("name", "tool"), "description": t.get("description", ""),
                                             "parameters": t.get("parameters", t.get("input_schema", {}))}}


def replay_requests(path: Path = REPLAYS) -> list[dict[str, Any]]:
    """Each recorded request as {"name", "messages", "tools"} in the chat template's terms."""
    out = []
    for agent, reqs in json.loads(path.read_text()).items():
        for n, r in enumerate(reqs):
            b = r["body"]
            system = [_text(b.get("system") or b.get("instructions") or "")]
            turns: list[dict[str, str]] = []
            for m in b.get("messages", b.get("input", [])):
                role, text = m.get("role", "user"), _text(m.get("content"))
                if role in ("system", "developer"):
                    system.append(text)
                elif turns and turns[-1]["role"] == role:
                    turns[-1]["content"] += "\n\n" + text
                else:
                    turns.append({"role": role, "content": text})
            sys_text = "\n\n".join(s for s in system if s)
            msgs = ([{"role": "system", "content": sys_text}] if sys_text else []) + turns
            out.append({"name": f"{agent}-{n}", "messages": msgs, "tools": [_tool(t) for t in b.get("tools") or []],
                        "user": turns[-1]["content"] if turns else "", "system": sys_text})
    return out


def greedy_reply(tm, prompt: list[int], max_new: int, stop: set[int], chunk: int = 2048) -> list[int]:
    import mlx.core as mx

    cache = tm.make_cache()
    x = mx.array(prompt)[None]
    for s in range(0, len(prompt), chunk):
        logits = tm(x[:, s : s + chunk], cache=cache)
        mx.eval(logits)
    out: list[int] = []
    nxt = int(mx.argmax(logits[0, -1]).item())
    while True:
        out.append(nxt)
        if nxt in stop or len(out) >= max_new:
            return out
        logits = tm(mx.array([[nxt]]), cache=cache)
        nxt = int(mx.argmax(logits[0, -1]).item())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--short", type=int, default=40, help="held-out short conversations")
    ap.add_argument("--long-tokens", default="10000,30000", help="agent-like long prompts' sizes; '' = none")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--acceptance-prompts", type=int, default=16, help="0 = skip the MTP measures")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    import mlx.core as mx
    from chat_samples import build_sample, load_sources, long_agent_messages
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(a.model))
    _, tm = load_served(a.model)
    sources = load_sources(a.stdlib, heldout=True)
    rng = np.random.default_rng(a.seed)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    stop = {im_end, tok.convert_tokens_to_ids("<|endoftext|>")}

    def render(msgs, tools, **kw) -> list[int]:
        text = tok.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=True, tokenize=False, **kw)
        return tok.encode(text, add_special_tokens=False)

    prompts: list[tuple[str, str, list[int]]] = []
    for i in range(a.short):
        prompts.append(("short", f"short-{i}", build_sample(rng, tok, sources).prompt))
    replays = replay_requests()
    for r in replays:
        prompts.append(("replay", r["name"], render(r["messages"], r["tools"])))
    base = next((r for r in replays if r["name"] == "claude-code-1"), replays[0])
    for n in [int(v) for v in a.long_tokens.split(",") if v]:
        msgs, tools = long_agent_messages(rng, sources, tok, n, replay=base)
        prompts.append(("long", f"long-{n}", render(msgs, tools)))

    rows = []
    for kind, name, p in prompts:
        t = time.perf_counter()
        out = greedy_reply(tm, p, a.max_new, stop)
        rows.append({"kind": kind, "name": name, "prompt_tokens": len(p), "reply_tokens": len(out),
                     "ended": out[-1] == im_end, "seconds": time.perf_counter() - t,
                     "reply": tok.decode(out)[:400]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "reply"}), flush=True)
    summary: dict[str, Any] = {}
    for kind in ("short", "replay", "long", "all"):
        sel = [r for r in rows if kind in ("all", r["kind"])]
        if sel:
            summary[kind] = {"prompts": len(sel), "ended": sum(r["ended"] for r in sel),
                             "ended_fraction": sum(r["ended"] for r in sel) / len(sel),
                             "mean_reply_tokens": float(np.mean([r["reply_tokens"] for r in sel]))}
    print(json.dumps({"chat": summary}), flush=True)
    result: dict[str, Any] = {"model": str(a.model), "device": f"MLX {mx.__version__} {mx.default_device()}",
                              "max_new": a.max_new, "chat": summary, "rows": rows}

    def write() -> None:  # after each part: a run cut by a timeout keeps what it measured
        result["eval_seconds"] = time.perf_counter() - t0
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=2))

    write()
    if a.acceptance_prompts:
        tokens = heldout_tokens(a.model, a.stdlib, limit=200_000)
        tf = teacher_forced(tm, tokens, 256, 32, 8)
        warm = greedy_acceptance(tm, tokens, a.acceptance_prompts, 64, 48, prefill_mtp=True)
        result["mtp"] = {"perplexity": tf["ppl"], "teacher_forced_agreement": tf["mtp_agreement"],
                         "greedy_acceptance": warm["acceptance"], "greedy": warm}
        print(json.dumps({"mtp": {k: v for k, v in result["mtp"].items() if k != "greedy"}}), flush=True)
        write()


if __name__ == "__main__":
    main()
