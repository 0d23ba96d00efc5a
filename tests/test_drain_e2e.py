"""The drain when the server is told to stop (host/drain.py), through the real server: on SIGTERM a request that ends
in time ends normally, and each one still running at --drain-timeout (or at a second signal) ends with a retryable
503 in its client's protocol, never a reset; then the process exits."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.plugin_status import SHARED_FLAGS
from support.server import Server, serve
from vllm_mlx_mtp_routing.host import drain, middleware

pytestmark = pytest.mark.server

LONG = 4000  # tokens: a request that would run well past the drain if nobody ended it


def _chat(server: Server, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": "def handler(event):"}], "temperature": 0,
            "max_tokens": max_tokens, "stream": stream}


async def _openai_stream(client: httpx.AsyncClient, payload: dict[str, Any], first: asyncio.Event,
                         after_signal: asyncio.Event) -> tuple[list[str], int]:
    """The stream's data lines, and how many content chunks came after the stop signal."""
    lines: list[str] = []
    late = 0
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line)
                first.set()
                late += after_signal.is_set()
    return lines, late


async def _anthropic_stream(client: httpx.AsyncClient, server: Server, first: asyncio.Event) -> list[str]:
    payload = {"model": server.model, "max_tokens": LONG, "stream": True,
               "messages": [{"role": "user", "content": "def handler(event):"}]}
    events: list[str] = []
    async with client.stream("POST", "/v1/messages", json=payload) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
                if line == "event: content_block_delta":
                    first.set()
            elif line.startswith("data: ") and events and events[-1] == "error":
                events.append(json.loads(line[6:])["error"]["type"])
    return events


def _openai_error(lines: list[str]) -> dict[str, Any]:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return json.loads(lines[-2][6:])["error"]


def test_requests_still_running_at_the_drain_timeout_get_a_retryable_503(tiny_vlm_bf16: Path, tmp_path: Path) -> None:
    with serve(tiny_vlm_bf16, *SHARED_FLAGS, "--drain-timeout", "1", log_dir=tmp_path) as server:
        async def run() -> tuple[Any, ...]:
            async with server.async_client(timeout=60) as client:
                firsts = [asyncio.Event(), asyncio.Event()]
                after = asyncio.Event()
                stream = asyncio.create_task(_openai_stream(client, _chat(server, LONG, True), firsts[0], after))
                messages = asyncio.create_task(_anthropic_stream(client, server, firsts[1]))
                plain = asyncio.create_task(client.post("/v1/chat/completions", json=_chat(server, LONG, False)))
                await asyncio.gather(*(f.wait() for f in firsts))
                short = asyncio.create_task(_openai_stream(client, _chat(server, 8, True), asyncio.Event(), after))
                await asyncio.sleep(0.05)
                server.proc.send_signal(signal.SIGTERM)
                after.set()
                return await asyncio.gather(stream, messages, plain, short)

        (lines, _), events, plain, (short_lines, _) = asyncio.run(run())
        assert server.proc.wait(timeout=60) is not None  # the process exits once they are ended
    error = _openai_error(lines)
    assert error["code"] == 503 and error["type"] == drain.KIND
    assert events[-3:] == ["error", "overloaded_error", "message_stop"]
    assert plain.status_code == 503 and plain.headers["retry-after"] == "1"
    assert plain.json()["error"]["type"] == drain.KIND
    assert short_lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in "".join(short_lines).replace('":"', '": "')
    assert "Draining: ending 3 requests still running (the drain timeout)" in server.log()


def test_a_second_signal_ends_at_once_what_an_unlimited_drain_waits_for(tiny_vlm_bf16: Path, tmp_path: Path) -> None:
    with serve(tiny_vlm_bf16, *SHARED_FLAGS, "--drain-timeout", "inf", log_dir=tmp_path) as server:
        async def run() -> tuple[tuple[list[str], int], bool]:
            async with server.async_client(timeout=60) as client:
                first, after = asyncio.Event(), asyncio.Event()
                stream = asyncio.create_task(_openai_stream(client, _chat(server, LONG, True), first, after))
                await first.wait()
                server.proc.send_signal(signal.SIGTERM)
                after.set()
                await asyncio.sleep(1.0)
                listening = await _connects(server)
                server.proc.send_signal(signal.SIGTERM)
                return await stream, listening

        (lines, late), listening = asyncio.run(run())
        assert server.proc.wait(timeout=60) is not None
    assert late > 1  # it went on streaming after the first signal
    assert not listening  # the listening socket closed at the first signal: a router's checks fail, it retries elsewhere
    assert _openai_error(lines)["code"] == 503
    assert "Draining: ending 1 requests still running (a second stop signal)" in server.log()


async def _connects(server: Server) -> bool:
    try:
        async with httpx.AsyncClient(timeout=5) as fresh:
            await fresh.get(f"{server.url}/health")
        return True
    except httpx.ConnectError:
        return False


def test_while_draining_health_is_unready_and_new_requests_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    state = drain.Drain()
    state.draining = True
    monkeypatch.setattr(drain, "DRAIN", state)

    async def answer(method: str, path: str) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})

        await middleware.PluginRequestMiddleware(app)({"type": "http", "method": method, "path": path, "headers": []}, None, send)
        return sent

    health = asyncio.run(answer("GET", "/health"))
    assert health[0]["status"] == 503 and json.loads(health[1]["body"])["status"] == "draining"
    refused = asyncio.run(answer("POST", "/v1/messages"))
    assert refused[0]["status"] == 503 and (b"retry-after", b"1") in refused[0]["headers"]
    assert asyncio.run(answer("GET", "/v1/models"))[0]["status"] == 200
