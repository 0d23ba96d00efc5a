"""A bounded, graceful drain when the server is told to stop (SIGTERM, Ctrl-C), for replicas behind a router.

What the host does by itself: vllm-mlx 0.6.0 runs uvicorn 0.54 with no limit on its graceful shutdown. On the first
SIGTERM or SIGINT uvicorn closes its listening socket at once (health checks and new connections are refused, so a
router retries them on another replica), closes idle keep-alive connections and waits, without limit, for the
requests still running before the engine stops. A supervisor's SIGKILL after its grace period (launchd, systemd,
Docker, Kubernetes) or a second Ctrl-C then resets every stream still running.

The drain bounds that wait: ``--drain-timeout`` seconds after the signal, every generation request still running is
ended with a retryable refusal and its work is cancelled: 503 with Retry-After when its client has no response yet,
else its event stream's error event (code 503, Anthropic ``overloaded_error``) and terminal frame. A second signal
does it at once. While draining, ``/health`` answers 503 and a new request on a connection still open gets a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

from .event_stream import ANTHROPIC_PATH, RESPONSES_PATH, error_and_terminal

logger = logging.getLogger("vllm_mlx_mtp_routing.bridge")

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_TIMEOUT_S = 30.0
RETRY_AFTER_S = 1
MESSAGE = "the server is shutting down: retry the request"
KIND = "server_shutting_down"
ANTHROPIC_KIND = "overloaded_error"  # the Anthropic API's retryable error type
# A client that reads nothing holds its stream's send: past this, its request is cancelled without a last frame.
_END_WAIT_S = 2.0
_CHAINED = "__vllm_mlx_drain__"


class Tracked:
    """One generation request's response on its way to its client: what went out, and a way to end it."""

    def __init__(self, send: Send, path: str) -> None:
        self._send = send
        self._path = path
        self._lock = asyncio.Lock()  # the drain's last frame never interleaves with the host's
        self.started = False  # the response start went out
        self.event_stream = False
        self.completed = False
        self.ended = False  # ended by the drain: the host's later messages are dropped
        self.task: asyncio.Task[Any] | None = None

    async def __call__(self, message: Message) -> None:
        async with self._lock:
            if self.ended:
                return
            if message["type"] == "http.response.start":
                self.started = True
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                self.event_stream = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self.completed = True
            await self._send(message)

    async def end(self) -> None:
        """The retryable refusal this response still has room for, then its work is cancelled."""
        try:
            await asyncio.wait_for(self._finish(), _END_WAIT_S)
        except asyncio.TimeoutError:
            pass
        finally:
            self.ended = True
            if self.task is not None and not self.completed:
                self.task.cancel()

    async def _finish(self) -> None:
        async with self._lock:
            if not (self.ended or self.completed):
                self.ended = True
                await self._last_message()

    async def _last_message(self) -> None:
        if not self.started:
            await refuse(self._send)
        elif self.event_stream:
            anthropic = self._path == ANTHROPIC_PATH
            frames = error_and_terminal(anthropic, self._path == RESPONSES_PATH, 503, ANTHROPIC_KIND if anthropic else KIND, MESSAGE)
            await self._send({"type": "http.response.body", "body": frames, "more_body": False})
        else:  # a plain body already under way (the host sends one in a single message): it can only end
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def refuse(send: Send) -> None:
    """503 with Retry-After, and the connection closed after it."""
    body = json.dumps({"error": {"message": MESSAGE, "type": KIND, "code": 503}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def unready(send: Send, running: int) -> None:
    """``/health`` while draining."""
    body = json.dumps({"status": "draining", "running_requests": running}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Drain:
    """The server process's drain: its deadline, the generation requests in flight, the signal it starts on."""

    def __init__(self) -> None:
        self.timeout_s: float | None = DEFAULT_TIMEOUT_S  # None: wait as long as the host does
        self.draining = False
        self._live: set[Tracked] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._deadline: asyncio.TimerHandle | None = None

    @property
    def running(self) -> int:
        return len(self._live)

    def configure(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s

    def arm(self) -> None:
        """Chain the drain onto the server's SIGINT and SIGTERM handlers. Called on the event loop's thread once the
        server serves (the lifespan's start): uvicorn 0.54 installs its own handlers (``Server.capture_signals``)
        before that and restores the ones before it on exit."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or threading.current_thread() is not threading.main_thread():
            logger.debug("drain: no event loop on the main thread, signals are not chained")
            return
        self._loop = loop
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if not callable(previous) or getattr(previous, _CHAINED, False):
                continue  # no Python-level handler to chain (the default stays), or chained already

            def handler(sig: int, frame: FrameType | None, previous: Callable[..., Any] = previous) -> None:
                self._signalled()
                previous(sig, frame)

            setattr(handler, _CHAINED, True)
            signal.signal(signum, handler)

    async def run(self, tracked: Tracked, call: Awaitable[None]) -> None:
        """Serve one generation request (``call``, the app with ``tracked`` as its send) as a task the drain can end."""
        task = asyncio.ensure_future(call)
        tracked.task = task
        self._live.add(tracked)
        try:
            await task
        except asyncio.CancelledError:
            if not (tracked.ended and task.cancelled()):
                raise
        finally:
            self._live.discard(tracked)

    def _signalled(self) -> None:
        # In the signal handler, on the main thread between two bytecodes of whatever runs: the work goes to the loop.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals > 1:
            self._expire("a second stop signal")
            return
        self.draining = True
        if self.timeout_s is None:
            logger.warning("Draining: %d requests running, waited for without limit (--drain-timeout inf); new requests get 503",
                           self.running)
            return
        logger.warning("Draining: %d requests running; new requests get 503; requests still running in %g s are ended with "
                       "a retryable 503 (--drain-timeout)", self.running, self.timeout_s)
        assert self._loop is not None  # set by arm
        self._deadline = self._loop.call_later(self.timeout_s, self._expire, "the drain timeout")

    def _expire(self, reason: str) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        live = [t for t in self._live if not t.ended]
        if live:
            logger.warning("Draining: ending %d requests still running (%s) with a retryable 503", len(live), reason)
        for tracked in live:
            asyncio.ensure_future(tracked.end())


DRAIN = Drain()
