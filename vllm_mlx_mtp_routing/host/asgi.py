"""Request context for hooks, the request's lifetime, and refusals that stay plain HTTP errors for streams.

The middleware that gives every request its context is middleware.py; a copy of an n > 1 request gets its own
(choices.py, through ``run_app``).

Lifetime. Whatever a request holds (an admission slot, a text-engine row) is released when its
ASGI call ends, however it ends: the middleware runs the callbacks registered with
``on_request_end`` in its own ``finally``. A generator's ``finally`` is not enough: on a client
disconnect vllm-mlx 0.6.0 closes its SSE wrapper, whose terminal-frame helper yields inside
``finally``, so the close fails and the inner generators are finalized only by the garbage collector.

The host's OpenAI stream yields its role chunk before it calls the engine, so a refusal raised by the
engine would otherwise land as an error frame inside a 200 stream. For streamed generation responses
this middleware holds the response start and the early chunks until the engine has either produced
its first output (then everything flows on) or refused the request (then the client gets the refusal
as the HTTP status). Clients see the role chunk together with the first token: time to first token is
unchanged.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..plugin_api.errors import RequestRejected
from .event_stream import EventStream

logger = logging.getLogger("vllm_mlx_mtp_routing.bridge")

# A stream still undecided after waiting this long (queued for admission, or a long prefill) gets its response
# start and the host's heartbeats, so clients and proxies with idle timeouts keep the connection. The wait
# counts from admission, not from the response start: under load the work before it (rendering, tokenizing)
# can take longer than this, and a refusal decided then must still be a plain 503.
HOLD_LIMIT_S = 2.0
# A stream that never reaches admission (a path the plugin does not admit) is let through after this long.
UNDECIDED_LIMIT_S = 10.0
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"([^"]{1,128})"')

Scope = dict[str, Any]
Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


@dataclass
class RequestContext:
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)  # the JSON body, fields the host's models drop included
    engine_started: bool = False
    waiting_since: float | None = None  # monotonic time the request went to admission: its own work was done
    rejection: RequestRejected | None = None
    stream_started: bool = False  # the client has the stream's response start: a refusal is a frame now
    refused: bool = False  # refused by a plugin (busy, bad input): the host's error logs for it are noise
    response_id: str | None = None  # the id in the first SSE chunk (chatcmpl-..., msg_...), for cancel by id
    cancel: Callable[[], bool] | None = None  # cancels what the engine runs for this request
    cleanups: list[Callable[[], Any]] = field(default_factory=list)
    sibling: Any = None  # a choices.Sibling: this request is one of the n copies of a request
    body_filters: list[Callable[[Message], Message]] = field(default_factory=list)  # amend response bodies on the way out
    path: str = ""  # the request's path (the middleware's; a copy of an n > 1 request has none)
    prompt_tokens: int | None = None  # set by usage.record
    cached_tokens: int | None = None  # set by usage.record
    finish_reason: str | None = None  # set by usage.record
    logprobs: dict[int, Any] | None = None  # set by logprobs_response.record, per choice index


# Requests whose stream showed its response id, by that id: cancel by id finds them here.
LIVE: dict[str, RequestContext] = {}


CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("vllm_mlx_plugin_request", default=None)


def current() -> RequestContext | None:
    return CURRENT.get()


class RefusalLogFilter(logging.Filter):
    """Drops the host's ERROR lines about a request a plugin refused: vllm-mlx 0.6.0 logs every exception
    out of a stream generator at ERROR ("Streaming error, ensuring terminal frame", "[disconnect_guard]
    generator raised"), so a burst of 503s would flood the log. The admission controller logs refusals at
    INFO, once per burst."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = CURRENT.get()
        return not (ctx is not None and ctx.refused and record.levelno >= logging.ERROR)


def on_request_end(callback: Callable[[], Any]) -> None:
    """Run ``callback`` when the current HTTP request ends, however it ends (no-op outside one)."""
    ctx = CURRENT.get()
    if ctx is not None:
        ctx.cleanups.append(callback)


def cancel_by_response_id(response_id: str) -> bool:
    ctx = LIVE.get(response_id)
    return bool(ctx is not None and ctx.cancel is not None and ctx.cancel())


def end_request(ctx: RequestContext) -> None:
    """The request is over: forget its response id, run what it registered (``on_request_end``)."""
    if ctx.response_id is not None:
        LIVE.pop(ctx.response_id, None)
    callbacks, ctx.cleanups = ctx.cleanups, []
    for callback in reversed(callbacks):
        try:
            callback()
        except Exception:  # one failed release must not skip the others
            logger.exception("request cleanup failed")


def error_body(exc: RequestRejected) -> dict[str, Any]:
    kind = "server_busy" if exc.status_code == 503 else "invalid_request_error"
    return {"error": {"message": exc.message, "type": kind, "code": exc.status_code}}


def error_headers(exc: RequestRejected) -> dict[str, str]:
    return {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after is not None else {}


async def run_app(app: Any, scope: Scope, receive: Any, send: Send, ctx: RequestContext) -> None:
    """One more request through ``app`` with its own context and lifetime (a copy of an n > 1 request)."""
    token = CURRENT.set(ctx)
    try:
        await app(scope, receive, HoldingSend(send, ctx))
    finally:
        end_request(ctx)
        CURRENT.reset(token)


def with_body_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    out = {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}
    if isinstance(scope.get("state"), dict):
        out["state"] = dict(scope["state"])
    return out


async def send_rejection(send: Send, exc: RequestRejected) -> None:
    await send_json(send, exc.status_code, error_body(exc), error_headers(exc))


async def send_json(send: Send, status: int, content: Any, extra_headers: dict[str, str] | None = None) -> None:
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra_headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class HoldingSend:
    """Holds an event stream's start and early chunks until the engine has decided on the request.

    A refusal decided while held replaces the stream with its plain HTTP status. A request still
    undecided ``HOLD_LIMIT_S`` after it went to admission (queued, or prefilling a long prompt), or
    ``UNDECIDED_LIMIT_S`` after its response start, is let through at the next message the host sends
    (its heartbeats come every few seconds): the client then has the response start and keep-alive
    comments, and a later refusal arrives as an error frame and ``[DONE]``.

    Every body goes out through the request's body filters, applied as it leaves (a held event then reads what
    the engine recorded meanwhile), and a 200 event stream through its ``EventStream`` (its protocol's
    keep-alive, never a silent end).
    """

    def __init__(self, send: Send, ctx: RequestContext) -> None:
        self._send = send
        self._ctx = ctx
        self._held: list[Message] | None = None
        self._held_since = 0.0
        self._replaced = False
        self._stream: EventStream | None = None

    async def __call__(self, message: Message) -> None:
        if self._replaced:
            return
        if message["type"] == "http.response.start":
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            if content_type.startswith(b"text/event-stream"):
                self._held = [message]
                self._held_since = time.monotonic()
                if int(message.get("status", 200)) == 200:
                    self._stream = EventStream(self._ctx.path, self._ctx.body)
                return
        elif self._stream is not None and message["type"] == "http.response.body":
            self._stream.arrived(message)
        if message["type"] != "http.response.start" and self._held is not None:
            if self._ctx.rejection is not None:
                self._replaced = True
                await send_rejection(self._send, self._ctx.rejection)
                return
            self._note_response_id(message)
            self._held.append(message)
            now, since = time.monotonic(), self._ctx.waiting_since
            waited = (since is not None and now - since >= HOLD_LIMIT_S) or now - self._held_since >= UNDECIDED_LIMIT_S
            if not (self._ctx.engine_started or waited or not message.get("more_body", False)):
                return
            held, self._held = self._held, None
            self._ctx.stream_started = True
            for m in held:
                await self._out(m)
            return
        await self._out(message)

    async def _out(self, message: Message) -> None:
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        for amend in self._ctx.body_filters:
            message = amend(message)
        for m in self._stream.outgoing(message) if self._stream is not None else [message]:
            await self._send(m)

    def _note_response_id(self, message: Message) -> None:
        if self._ctx.response_id is None and message["type"] == "http.response.body":
            match = _RESPONSE_ID.search(message.get("body", b"")[:4096])
            if match:
                self._ctx.response_id = match.group(1).decode("latin-1")
                LIVE[self._ctx.response_id] = self._ctx
