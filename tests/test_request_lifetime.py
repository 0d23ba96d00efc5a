"""What a request holds is released when its ASGI call ends, whether or not its generators are ever finalized,
and a stream left waiting gets its response start after the hold limit."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from vllm_mlx_mtp_routing.host import asgi
from vllm_mlx_mtp_routing.host.middleware import PluginRequestMiddleware
from vllm_mlx_mtp_routing.plugin_api.errors import RequestRejected

KEEP: list[Any] = []  # generators parked here are never finalized while the test runs


def _scope(path: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")]}


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": json.dumps({"seed": 1}).encode(), "more_body": False}


def _run(app: Any) -> tuple[list[str], list[dict[str, Any]], BaseException | None]:
    released: list[str] = []
    sent: list[dict[str, Any]] = []
    raised: list[BaseException] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def main() -> None:
        try:
            await PluginRequestMiddleware(lambda s, r, snd: app(s, r, snd, released))(_scope(), _receive, send)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            raised.append(exc)
        snapshot.extend(released)  # before asyncio.run finalizes leftover generators at shutdown

    snapshot: list[str] = []
    asyncio.run(main())
    return snapshot, sent, raised[0] if raised else None


def test_release_runs_at_request_end_even_if_the_generator_is_never_closed() -> None:
    async def app(scope: Any, receive: Any, send: Any, released: list[str]) -> None:
        await receive()

        async def body() -> Any:
            asgi.on_request_end(lambda: released.append("slot"))
            try:
                yield b"data: {}\n\n"
                yield b"data: {}\n\n"
            finally:  # never reached while the test runs: the generator is parked, not closed
                released.append("finally")

        gen = body()
        KEEP.append(gen)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": await gen.__anext__(), "more_body": True})
        raise OSError("client went away")  # as a disconnect surfaces mid-stream

    released, _, raised = _run(app)
    assert isinstance(raised, OSError)
    assert released == ["slot"]  # the generator's finally has not run, the release has


def test_cleanups_run_on_cancel_even_if_one_fails() -> None:
    async def app(scope: Any, receive: Any, send: Any, released: list[str]) -> None:
        asgi.on_request_end(lambda: released.append("slot"))
        asgi.on_request_end(lambda: (_ for _ in ()).throw(RuntimeError("a failing cleanup")))
        raise asyncio.CancelledError

    released, _, raised = _run(app)
    assert isinstance(raised, asyncio.CancelledError)
    assert released == ["slot"]


def test_cleanups_run_once_and_in_reverse_order() -> None:
    async def app(scope: Any, receive: Any, send: Any, released: list[str]) -> None:
        asgi.on_request_end(lambda: released.append("ticket"))
        asgi.on_request_end(lambda: released.append("row"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    released, sent, _ = _run(app)
    assert released == ["row", "ticket"]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_undecided_stream_is_let_through_after_the_hold_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asgi, "HOLD_LIMIT_S", 0.05)

    async def app(scope: Any, receive: Any, send: Any, released: list[str]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"id":"chatcmpl-1"}\n\n', "more_body": True})
        asgi.current().waiting_since = time.monotonic()  # queued for admission
        await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": b": heartbeat\n\n", "more_body": True})
        asgi.current().rejection = RequestRejected(503, "queue timeout")  # too late for a status: a frame instead
        await send({"type": "http.response.body", "body": b"data: {\"error\": {}}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    _, sent, _ = _run(app)
    assert sent[0]["status"] == 200
    bodies = b"".join(m.get("body", b"") for m in sent[1:])
    assert b"heartbeat" in bodies and bodies.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("limit", ["hold", "undecided"])
def test_the_hold_limit_counts_from_admission(monkeypatch: pytest.MonkeyPatch, limit: str) -> None:
    """Under load the work before admission (rendering, tokenizing 24 prompts on 2 cores) can outlast the
    hold limit; a queue-full refusal decided after it is still a plain 503. A stream that never reaches
    admission is let through after the longer limit."""
    monkeypatch.setattr(asgi, "HOLD_LIMIT_S", 0.05)
    monkeypatch.setattr(asgi, "UNDECIDED_LIMIT_S", 0.05 if limit == "undecided" else 60.0)

    async def app(scope: Any, receive: Any, send: Any, released: list[str]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await asyncio.sleep(0.1)  # the host's role chunk, long after the start; admission not reached yet
        await send({"type": "http.response.body", "body": b'data: {"id":"chatcmpl-1"}\n\n', "more_body": True})
        asgi.current().waiting_since = time.monotonic()
        asgi.current().rejection = RequestRejected(503, "queue full", retry_after=3)
        await send({"type": "http.response.body", "body": b"data: {\"error\": {}}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    _, sent, _ = _run(app)
    if limit == "hold":
        assert sent[0]["status"] == 503 and (b"retry-after", b"3") in sent[0]["headers"]
        assert len(sent) == 2 and json.loads(sent[1]["body"])["error"]["code"] == 503
    else:
        assert sent[0]["status"] == 200 and sent[-1]["body"] == b"data: [DONE]\n\n"


def test_refusal_while_held_is_a_plain_status() -> None:
    async def app(scope: Any, receive: Any, send: Any, released: list[str]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        asgi.current().rejection = RequestRejected(503, "busy", retry_after=7)
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})

    _, sent, _ = _run(app)
    assert sent[0]["status"] == 503 and (b"retry-after", b"7") in sent[0]["headers"]
