"""Coding agents' requests, recorded and trimmed to a tiny model's context, for replays through the real server.

``tests/data/agent_replays.json`` holds, per agent CLI (Qwen Code, OpenCode, Claude Code, Codex), the bodies of its
first requests of a session as the CLI sent them to a local server (docs/agents.md says how they were run), each
string cut to a few hundred characters and the tool list to its first few, so a prompt fits a 1K-token context; every
field the CLI sent is kept (``max_tokens`` 8000 or 32000, ``stream_options``, ``thinking``, ``context_management``,
``output_config``, ``reasoning``, ``include``, ``store``, ``prompt_cache_key`` ...), as are its message shapes
(Claude Code's system message after the user turn, Codex's two developer messages, OpenCode's consecutive user
messages). A follow-up turn is the first turn plus the assistant's reply and the next user message, in the agent's own
protocol.

Rebuild the file from new captures (JSON lines of ``{"path", "body"}``, e.g. a logging proxy's):

  PYTHONPATH=tests python -m support.agent_replays captures.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data" / "agent_replays.json"
TEXT_CHARS = 60  # a string longer than this keeps its start
TOOLS = 2  # tools kept per request
PROPERTIES = 2  # parameters kept per tool
AGENTS = {"QwenCode": "qwen-code", "opencode": "opencode", "claude-cli": "claude-code", "codex": "codex"}
REPLY = "add(2, 3) returns -1, because it subtracts."
FOLLOW_UP = "Which line of calc.py is wrong? Answer in one sentence."


def load() -> dict[str, list[dict[str, Any]]]:
    """{agent: [{"path", "body"}, ...]} in the order the agent sent them."""
    return json.loads(DATA.read_text())


def _cut(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= TEXT_CHARS else value[:TEXT_CHARS] + " [...]"
    if isinstance(value, list):
        return [_cut(v) for v in value]
    if isinstance(value, dict):
        return {k: (v if k in ("type", "role", "name") else _cut(v)) for k, v in value.items()}
    return value


def trim(body: dict[str, Any]) -> dict[str, Any]:
    """The body with its long strings cut and its tools cut to the first ``TOOLS``; identifiers made up."""
    out = _cut(copy.deepcopy(body))
    if isinstance(out.get("tools"), list):
        out["tools"] = [_fewer_parameters(t) for t in out["tools"][:TOOLS]]
    out.pop("metadata", None)  # a device id
    for key in ("prompt_cache_key", "client_metadata"):
        if key in out:
            out[key] = "replay" if isinstance(out[key], str) else {"x-replay": "1"}
    out["model"] = "MODEL"
    return out


def _fewer_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool with its first ``PROPERTIES`` parameters (the formats differ in where the JSON schema sits)."""
    for holder in (tool, tool.get("function") or {}):
        for key in ("parameters", "input_schema"):
            schema = holder.get(key)
            if isinstance(schema, dict) and isinstance(schema.get("properties"), dict):
                kept = dict(list(schema["properties"].items())[:PROPERTIES])
                schema["properties"] = kept
                if isinstance(schema.get("required"), list):
                    schema["required"] = [r for r in schema["required"] if r in kept]
    return tool


def follow_up(path: str, body: dict[str, Any], reply: str = REPLY, question: str = FOLLOW_UP) -> dict[str, Any]:
    """The next turn of ``body``'s conversation: its messages, the assistant's ``reply``, then ``question``."""
    out = copy.deepcopy(body)
    if path == "/v1/responses":
        out["input"] = [*out["input"], {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": reply}]},
                        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]}]
    elif path == "/v1/messages":
        out["messages"] = [*out["messages"], {"role": "assistant", "content": [{"type": "text", "text": reply}]},
                           {"role": "user", "content": [{"type": "text", "text": question}]}]
    else:
        out["messages"] = [*out["messages"], {"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="PYTHONPATH=tests python -m support.agent_replays", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("captures", type=Path, help="JSON lines with path, body and headers (user-agent names the agent)")
    args = ap.parse_args(argv)
    out: dict[str, list[dict[str, Any]]] = {}
    for line in args.captures.read_text().splitlines():
        record = json.loads(line)
        agent = next((name for tag, name in AGENTS.items() if tag in record.get("headers", {}).get("user-agent", "")), None)
        if agent is None or not isinstance(record.get("body"), dict) or not record["path"].startswith("/v1/"):
            continue
        out.setdefault(agent, []).append({"path": record["path"], "body": trim(record["body"])})
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print({agent: [r["path"] for r in reqs] for agent, reqs in out.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
