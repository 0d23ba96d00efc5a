"""Coding agents' requests replayed through the real server: what Qwen Code, OpenCode, Claude Code and Codex send at the
start of a session (support/agent_replays.py; trimmed to the 1K-token context of the module's model, every field and
message shape kept), then a follow-up turn, then a hang-up and a retry.

Each request is served with the agent's default ``max_tokens`` (8000 or 32000: cut to what the context leaves), its
stream ends in its protocol's own way, a follow-up turn reuses the first turn's prompt, and a retry after a hang-up
resumes from what the first attempt prefilled and answers as a cold run does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import agent_replays
from support.plugin_status import SHARED_FLAGS, wait_idle
from support.server import Server

pytestmark = pytest.mark.server

CONTEXT = 1024  # tiny_vlm_bf16_1k
REPLAYS = agent_replays.load()


@pytest.fixture(scope="module")
def server(tiny_vlm_bf16_1k: Path, shared_server: Callable[..., Server]) -> Server:
    return shared_server(tiny_vlm_bf16_1k, *SHARED_FLAGS)


@dataclass
class Turn:
    text: str
    finish: str | None
    prompt_tokens: int  # all of the prompt, cached or not
    cached_tokens: int
    completion_tokens: int
    ended: bool  # the stream closed the protocol's way ([DONE], message_stop, response.completed)


def _frames(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def parse(path: str, text: str) -> Turn:
    """A streamed response in its protocol, read as its client would."""
    frames = _frames(text)
    if path == "/v1/messages":
        start = next(f["message"]["usage"] for f in frames if f["type"] == "message_start")
        delta = next(f for f in frames if f["type"] == "message_delta")
        cached = max(start.get("cache_read_input_tokens") or 0, delta["usage"].get("cache_read_input_tokens") or 0)
        return Turn("".join(f["delta"].get("text", "") for f in frames if f["type"] == "content_block_delta"),
                    delta["delta"]["stop_reason"], start["input_tokens"] + cached, cached, delta["usage"]["output_tokens"],
                    frames[-1]["type"] == "message_stop")
    if path == "/v1/responses":
        done = frames[-1]
        usage = done["response"]["usage"]
        return Turn("".join(f.get("delta", "") for f in frames if f["type"] == "response.output_text.delta"),
                    done["response"]["status"], usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
                    usage["output_tokens"], done["type"] == "response.completed")
    usage = next(f["usage"] for f in reversed(frames) if f.get("usage"))
    return Turn("".join((f["choices"][0]["delta"].get("content") or "") for f in frames if f.get("choices")),
                next((f["choices"][0]["finish_reason"] for f in frames if f.get("choices") and f["choices"][0].get("finish_reason")), None),
                usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                usage["completion_tokens"], text.rstrip().endswith("data: [DONE]"))


def replay(server: Server, path: str, body: dict[str, Any], **extra: Any) -> Turn:
    payload = {**body, "model": server.model, **extra}
    with httpx.Client(base_url=server.url, timeout=120) as client, client.stream("POST", path, json=payload) as response:
        text = "".join(response.iter_text())
    assert response.status_code == 200, text
    return parse(path, text)


@pytest.mark.parametrize("agent", sorted(REPLAYS))
def test_an_agents_first_requests_and_its_follow_up_are_served(server: Server, agent: str) -> None:
    turns = []
    for request in REPLAYS[agent]:
        assert request["body"].get("max_tokens", CONTEXT) >= CONTEXT or "max_output_tokens" not in request["body"]
        turn = replay(server, request["path"], request["body"], cache_salt=f"replay-{agent}")
        assert turn.ended and turn.finish in ("length", "stop", "max_tokens", "end_turn", "completed", "incomplete"), turn
        assert 0 < turn.prompt_tokens + turn.completion_tokens <= CONTEXT  # a max_tokens past the context is cut to it
        turns.append(turn)
    last = REPLAYS[agent][-1]
    # a short reply stands for the first turn's (the tiny model's runs to the context's end: no room for a next turn)
    again = replay(server, last["path"], agent_replays.follow_up(last["path"], last["body"]), cache_salt=f"replay-{agent}")
    assert again.ended and again.prompt_tokens > turns[-1].prompt_tokens
    assert again.cached_tokens > 0.5 * turns[-1].prompt_tokens  # the first turn's prompt, reused
    wait_idle(server, within=5.0)


async def _first_delta(lines: Any) -> None:
    async for line in lines:
        if line.startswith("event: content_block_delta"):
            return


def test_a_retry_after_a_hang_up_resumes_and_answers_as_a_cold_run(server: Server) -> None:
    """Claude Code's stream watchdog hangs up a long wait and retries non-streamed: the retry starts from what the
    first attempt prefilled, and its answer is the one a cold run gives."""
    request = REPLAYS["claude-code"][-1]
    body = {**request["body"], "model": server.model, "cache_salt": "replay-retry", "temperature": 0}

    async def hang_up() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async with client.stream("POST", request["path"], json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                while not (await lines.__anext__()).startswith("event: message_start"):
                    pass
                # leaving closes the connection: mid-prefill, or (a fast machine) once the first token came
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_first_delta(lines), timeout=0.5)

    asyncio.run(hang_up())
    retry = server.post(request["path"], json={**body, "stream": False}, timeout=120).json()
    cold = server.post(request["path"], json={**body, "stream": False, "cache_salt": "replay-cold"}, timeout=120).json()
    assert retry["usage"]["cache_read_input_tokens"] > 0 and not cold["usage"].get("cache_read_input_tokens")
    assert retry["content"] == cold["content"] and retry["stop_reason"] == cold["stop_reason"]
    wait_idle(server, within=5.0)
