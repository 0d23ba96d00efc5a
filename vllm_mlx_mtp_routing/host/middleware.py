"""The ASGI middleware the bridge adds to the host's app: every HTTP request gets its context (asgi.py).

A generation request's body is read before the host's handler runs (request_body.py) and checked
(body_checks.py): a body the handler would trip over is a 400 naming the field, after the host's own
access checks (access.py). Its JSON is kept on the context for the hooks, and a request for n > 1 choices
is served as n copies, each with its own context (choices.py). Each one is served as a task the drain
(drain.py) can end when the server stops; while it drains, ``/health`` and new requests get a 503.
"""

from __future__ import annotations

import json
from typing import Any

from ..plugin_api.errors import RequestRejected
from . import access, body_checks, choices, drain, request_body
from .asgi import CURRENT, HoldingSend, RequestContext, Scope, Send, end_request, send_json, send_rejection, with_body_length

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
# Bodies read and checked before the host's handler; the OpenAI aliases are filled in on the generation paths only.
CHECKED_PATHS = (*GENERATION_PATHS, "/v1/responses", "/v1/messages/count_tokens")


class PluginRequestMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if drain.DRAIN.draining and await _refused_while_draining(scope, send):
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        ctx = RequestContext(headers=headers, path=str(scope.get("path", "")))
        token = CURRENT.set(ctx)
        try:
            if scope.get("method") == "POST" and scope.get("path") in CHECKED_PATHS:
                await self._generation(scope, receive, send, ctx)
            else:
                await self.app(scope, receive, send)
        finally:
            end_request(ctx)
            CURRENT.reset(token)

    async def _generation(self, scope: Scope, receive: Any, send: Send, ctx: RequestContext) -> None:
        """The body is read and checked first: its JSON is kept for the hooks, OpenAI aliases the host
        lacks are filled in, and a request for n > 1 choices runs as n copies (choices.py)."""
        path = scope["path"]
        coding = ctx.headers.get("content-encoding", "").strip().lower()
        if coding not in ("", "identity"):  # neither uvicorn nor the host decompresses a body: it would read as junk
            await _refuse(scope, send, RequestRejected(
                415, f"Content-Encoding {coding!r} is not supported: request bodies are read as sent; send the JSON uncompressed"))
            return
        raw = await request_body.read(receive)
        try:
            body = request_body.parse(raw)
            if body is not None:
                body_checks.check(path, body)
            n = choices.requested(path, body or {})
        except RequestRejected as exc:
            await _refuse(scope, send, exc)
            return
        changed = body is not None and (request_body.drop_null_stream(body) | body_checks.drop_nulls(path, body))
        if body is not None and path in GENERATION_PATHS and request_body.fill_aliases(body):
            changed = True
        if changed:
            raw = json.dumps(body).encode()
            scope = with_body_length(scope, len(raw))
        ctx.body = body or {}
        tracked = drain.Tracked(send, path)
        if n > 1:
            await drain.DRAIN.run(tracked, choices.fan_out(self.app, scope, ctx.body, n, ctx, receive, tracked))
            return
        await drain.DRAIN.run(tracked, self.app(scope, request_body.replay(raw, receive), HoldingSend(tracked, ctx)))


async def _refused_while_draining(scope: Scope, send: Send) -> bool:
    """While the server drains, ``/health`` is unready and a new generation request is refused (503, retryable)."""
    path, method = scope.get("path"), scope.get("method")
    if path == "/health":
        await drain.unready(send, drain.DRAIN.running)
        return True
    if method == "POST" and path in CHECKED_PATHS:
        await drain.refuse(send)
        return True
    return False


async def _refuse(scope: Scope, send: Send, exc: RequestRejected) -> None:
    """The plugin's refusal of a body, unless the host's own access checks refuse the request first."""
    denied = await access.refusal(scope)
    if denied is not None:
        await send_json(send, denied.status_code, {"detail": denied.detail}, dict(denied.headers or {}))
        return
    await send_rejection(send, exc)
