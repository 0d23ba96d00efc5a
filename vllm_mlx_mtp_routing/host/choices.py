"""OpenAI ``n`` on /v1/chat/completions and /v1/completions: n copies of the request, one response.

vllm-mlx 0.6.0 drops ``n`` (its request models ignore unknown fields) and builds one choice per
engine call, each through its own post-processing (reasoning and tool-call parsing, response
format). So the request runs n times through the host's own handler, each copy with its own
request context, and the n responses are merged: choices indexed 0..n-1 (with several prompts,
prompt p's choice j is p * n + j), usage with the prompt counted once and the completion tokens
summed, one response id. Each copy is a whole request: whatever the host builds per request
(logits processors, stop strings) belongs to that row alone. With a ``seed``, copy j samples with
seed + j, so the n completions differ and are reproducible (copy 0 is the request with n=1). On the
text path the copies share one ``SharedPrefill``: the prompt is prefilled once.

Streams: every copy must have started (its first token, or its refusal) before the response starts;
a refusal by any copy is the response's status. Chunks are passed on as they come, each copy's
choices renumbered; one ``[DONE]`` ends the stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..plugin_api.errors import RequestRejected
from ..text_engine.shared_prefill import SharedPrefill
from . import asgi

CHOICE_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_CHOICES = 16
SEED_LIMIT = 2**64

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class Sibling:
    """On a copy's request context: which of the n it is, and the prefill its rows share."""

    index: int
    n: int
    share: SharedPrefill


def requested(path: str, body: dict[str, Any]) -> int:
    """The number of choices asked for (1 when ``n`` is absent or null); RequestRejected(400) if invalid."""
    if path not in CHOICE_PATHS or body.get("n") is None:
        return 1
    n = body["n"]
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise RequestRejected(400, f"n must be an integer in [1, {MAX_CHOICES}], got {body['n']!r}")
    return n


def copy_body(body: dict[str, Any], j: int) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k != "n"}
    seed = out.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < SEED_LIMIT:
        out["seed"] = (seed + j) % SEED_LIMIT
    return out


class _Copy:
    """One copy of the request: its messages to the client arrive on the shared queue, tagged."""

    def __init__(self, j: int, events: asyncio.Queue[tuple[int, str, Any]]) -> None:
        self.j = j
        self.events = events
        self.ctx: Any = None

    async def send(self, message: Message) -> None:
        self.events.put_nowait((self.j, message["type"], message))


async def fan_out(
    app: Any, scope: dict[str, Any], body: dict[str, Any], n: int, parent: Any, receive: Any, send: Send
) -> None:
    """Serve ``body`` (asking for ``n`` > 1 choices) as n copies through ``app``; one merged response."""
    share = SharedPrefill(n)
    events: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
    gone = asyncio.Event()
    copies = [_Copy(j, events) for j in range(n)]

    async def watch() -> None:  # the client's disconnect reaches every copy
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                return

    async def run(c: _Copy) -> None:
        raw = json.dumps(copy_body(body, c.j)).encode()
        c.ctx = asgi.RequestContext(headers=dict(parent.headers), body=json.loads(raw))
        c.ctx.sibling = Sibling(c.j, n, share)
        sent = [False]

        async def copy_receive() -> Message:
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        try:
            await asgi.run_app(app, asgi.with_body_length(scope, len(raw)), copy_receive, c.send, c.ctx)
        except Exception as exc:
            events.put_nowait((c.j, "raised", exc))
        finally:
            events.put_nowait((c.j, "ended", None))

    watcher = asyncio.create_task(watch())
    tasks = [asyncio.create_task(run(c)) for c in copies]
    parent.cancel = lambda: any([bool(c.ctx and c.ctx.cancel and c.ctx.cancel()) for c in copies])
    try:
        merge = _StreamMerge if body.get("stream") else _JsonMerge
        await merge(n, events, send, parent).run()
    finally:
        for t in (*tasks, watcher):
            t.cancel()
        await asyncio.gather(*tasks, watcher, return_exceptions=True)


class _Merge:
    def __init__(self, n: int, events: asyncio.Queue[tuple[int, str, Any]], send: Send, parent: Any) -> None:
        self.n = n
        self.events = events
        self.send = send
        self.parent = parent
        self.status: dict[int, int] = {}
        self.headers: dict[int, list[tuple[bytes, bytes]]] = {}
        self.bodies: dict[int, list[bytes]] = {j: [] for j in range(n)}
        self.ended: set[int] = set()

    async def next(self) -> tuple[int, str, Any]:
        j, kind, payload = await self.events.get()
        if kind == "raised":
            raise payload
        if kind == "ended":
            self.ended.add(j)
            if j not in self.status:
                raise RuntimeError(f"choice {j}: the handler ended without a response")
        elif kind == "http.response.start":
            self.status[j] = int(payload["status"])
            self.headers[j] = list(payload.get("headers", []))
        return j, kind, payload

    def failed(self) -> int | None:
        """The first copy refused (a status other than 200) whose whole response is in."""
        bad = [j for j, s in self.status.items() if s != 200 and j in self.ended]
        return min(bad) if bad else None

    async def send_whole(self, j: int) -> None:
        await self.send({"type": "http.response.start", "status": self.status[j], "headers": self.headers[j]})
        await self.send({"type": "http.response.body", "body": b"".join(self.bodies[j]), "more_body": False})


class _JsonMerge(_Merge):
    async def run(self) -> None:
        while len(self.ended) < self.n:
            j, kind, payload = await self.next()
            if kind == "http.response.body":
                self.bodies[j].append(payload.get("body", b""))
            if (bad := self.failed()) is not None:
                await self.send_whole(bad)
                return
        docs = [json.loads(b"".join(self.bodies[j]) or b"{}") for j in range(self.n)]
        merged = dict(docs[0])
        merged["choices"] = sorted(
            ({**c, "index": int(c.get("index", 0)) * self.n + j} for j, d in enumerate(docs) for c in d.get("choices") or ()),
            key=lambda c: c["index"],
        )
        usage = merged_usage([d.get("usage") for d in docs])
        if usage is not None:
            merged["usage"] = usage
        raw = json.dumps(merged).encode()
        headers = [(k, v) for k, v in self.headers[0] if k.lower() != b"content-length"]
        await self.send({"type": "http.response.start", "status": 200, "headers": [*headers, (b"content-length", str(len(raw)).encode())]})
        await self.send({"type": "http.response.body", "body": raw, "more_body": False})


def merged_usage(usages: list[Any]) -> dict[str, Any] | None:
    """One prompt, n completions: the prompt counted once, the completion tokens summed."""
    usages = [u for u in usages if isinstance(u, dict)]
    if not usages:
        return None
    out = dict(usages[0])
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    out["completion_tokens"] = completion
    out["total_tokens"] = int(out.get("prompt_tokens") or 0) + completion
    return out


class _StreamMerge(_Merge):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pending: dict[int, bytes] = {j: b"" for j in range(self.n)}
        self.usage: dict[int, Any] = {}
        self.finished: set[int] = set()
        self.usage_chunk: dict[str, Any] | None = None  # a usage-only chunk was asked for (include_usage)
        self.first: dict[str, Any] | None = None  # the first chunk: the response's id, object, model
        self.started = False

    async def run(self) -> None:
        early: list[tuple[int, bytes]] = []
        while len(self.ended) < self.n:
            j, kind, payload = await self.next()
            if kind == "http.response.body":
                chunk = payload.get("body", b"")
                if self.status.get(j) != 200:
                    self.bodies[j].append(chunk)
                elif self.started:
                    await self.forward(j, chunk)
                else:
                    early.append((j, chunk))
            if not self.started:
                if (bad := self.failed()) is not None:
                    await self.send_whole(bad)
                    return
                if len(self.status) == self.n and all(s == 200 for s in self.status.values()):
                    headers = [(k, v) for k, v in self.headers[0] if k.lower() != b"content-length"]
                    await self.send({"type": "http.response.start", "status": 200, "headers": headers})
                    self.started = True
                    for e in early:
                        await self.forward(*e)
        if not self.started:  # a copy's non-200 stream that never ended cannot happen: ended is all n
            raise RuntimeError("no response start from every choice")
        tail = ""
        usage = merged_usage([self.usage.get(j) for j in range(self.n)])
        if self.usage_chunk is not None and usage is not None:
            tail += _event({**self.usage_chunk, "usage": usage})
        await self.send({"type": "http.response.body", "body": (tail + "data: [DONE]\n\n").encode(), "more_body": False})

    async def forward(self, j: int, chunk: bytes) -> None:
        data = self.pending[j] + chunk
        *events, self.pending[j] = data.split(b"\n\n")
        out = [e for e in (self.rewrite(j, ev.decode("utf-8", "replace")) for ev in events) if e]
        if out:
            await self.send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": True})

    def rewrite(self, j: int, event: str) -> str:
        data = [line[5:].lstrip() for line in event.split("\n") if line.startswith("data:")]
        if not data:
            return event + "\n\n" if event.strip() else ""  # a heartbeat comment
        payload = "\n".join(data)
        if payload.strip() == "[DONE]":
            return ""
        try:
            obj = json.loads(payload)
        except ValueError:
            return event + "\n\n"
        if not isinstance(obj, dict) or "choices" not in obj:
            return event + "\n\n"  # an error frame: the client sees which choice failed by its absence
        if self.first is None:
            self.first = {k: obj.get(k) for k in ("id", "object", "created", "model")}
            self.note_response_id(str(self.first["id"]))
        obj["id"] = self.first["id"]
        if obj.get("usage") is not None:
            self.usage[j] = obj["usage"]
        if not obj["choices"]:
            if obj.get("usage") is not None:
                self.usage_chunk = {k: v for k, v in obj.items() if k != "usage"}
            return ""
        for c in obj["choices"]:
            c["index"] = int(c.get("index", 0)) * self.n + j
            if c.get("finish_reason"):
                self.finished.add(j)
        if "usage" in obj:
            # the finishing chunk of the last choice carries the whole request's usage
            last = len(self.finished) == self.n and obj.get("usage") is not None
            obj["usage"] = merged_usage([self.usage.get(i) for i in range(self.n)]) if last else None
        return _event(obj)

    def note_response_id(self, response_id: str) -> None:
        self.parent.response_id = response_id
        asgi.LIVE[response_id] = self.parent



def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
