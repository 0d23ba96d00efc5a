"""Memory-aware admission: a request runs only while its projected memory fits the budget.

How live memory and reservations combine. Every running request holds a reservation: its
projected peak (`MemoryModel.project_parts`), persistent part plus prefill working set until
`Ticket.prefill_done()`. `baseline` is `active_memory()` measured whenever no request holds a ticket
(weights, prefix caches, anything resident between requests). A request is admitted when

    max(live_active, baseline + sum(reservations)) + its projection <= budget

Running requests' memory shows up in live_active as it is allocated, but never above their
reservations, so taking the max instead of the sum counts it once; live_active wins only when
something unaccounted for holds memory (untracked requests, buffers not yet freed), and then the
controller waits for it. A request whose projection exceeds `budget - baseline` could not run even
on an idle server and is refused with 413 at once. Everything else waits in policy order (strictly:
the head must fit before anyone behind it runs) up to `max_queue`; a full queue or a wait past
`queue_timeout_s` is 503 with Retry-After. All of that is decided in `acquire`, before any stream
starts. Waiters re-check every `poll_interval_s` as well as on every release, so memory freed
outside the controller (e.g. a cleared cache) is noticed.

Thread safety: state is guarded by a lock and waiters are woken with call_soon_threadsafe, so
`Ticket.release()` may be called from an engine thread; `acquire` runs on an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ..plugin_api.errors import RequestRejected
from .memory_model import MemoryModel, Projection
from .policies import POLICIES, QueuedRequest, sort_key
from .refusals import BurstLog, DrainRate

if TYPE_CHECKING:
    from .cli import AdmissionSettings

logger = logging.getLogger(__name__)

GiB = 1 << 30
_REJECT_REASONS = ("queue_full", "queue_timeout", "too_large")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


class Ticket:
    """A running request's hold on the controller. `release()` is idempotent and thread-safe."""

    def __init__(self, controller: AdmissionController, request: QueuedRequest, projection: Projection,
                 path: str, queue_wait_s: float, admitted_at: float) -> None:
        self._controller = controller
        self.request = request
        self.path = path
        self.queue_wait_s = queue_wait_s
        self.admitted_at = admitted_at
        self.persistent_bytes = projection.persistent_bytes
        self.transient_bytes = projection.transient_bytes
        self.released = False

    @property
    def id(self) -> int:
        return self.request.seq

    @property
    def reserved_bytes(self) -> int:
        return 0 if self.released else self.persistent_bytes + self.transient_bytes

    def release(self) -> None:
        self._controller._release(self)

    def prefill_done(self) -> None:
        """Give back the prefill working set once the prompt is in the cache."""
        self._controller._shrink(self)

    def bind(self, owner: Any) -> None:
        """Release when `owner` is garbage-collected: a safety net for a response stream that is
        dropped before it ever runs (its `finally` never executes then)."""
        weakref.finalize(owner, self.release)

    def __repr__(self) -> str:
        state = "released" if self.released else f"{_gib(self.reserved_bytes)} reserved"
        return f"Ticket(id={self.id}, path={self.path}, {state})"


@dataclass(eq=False)
class _Waiter:
    request: QueuedRequest
    projection: Projection
    path: str
    loop: asyncio.AbstractEventLoop
    enqueued_at: float
    timeout_s: float | None = None  # how long it may wait: the queue timeout, or less for this request
    event: asyncio.Event = field(default_factory=asyncio.Event)
    ticket: Ticket | None = None


class AdmissionController:
    def __init__(
        self,
        *,
        budget_bytes: int,
        max_running: int,
        max_queue: int,
        queue_timeout_s: float | None,
        policy: str = "fifo",
        memory_model: MemoryModel | None = None,
        path_models: dict[str, MemoryModel] | None = None,
        active_memory: Callable[[], int] = mx.get_active_memory,
        headroom_bytes: int = 0,
        device_bytes: int | None = None,
        device_source: str = "",
        poll_interval_s: float = 0.25,
        wait_window: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        cache_bytes: Callable[[], int] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduler policy {policy!r}")
        if max_running < 1 or max_queue < 0 or budget_bytes <= 0:
            raise ValueError("need max_running >= 1, max_queue >= 0 and budget_bytes > 0")
        self.budget_bytes = int(budget_bytes)
        self.max_running = int(max_running)
        self.max_queue = int(max_queue)
        self.queue_timeout_s = queue_timeout_s if queue_timeout_s and math.isfinite(queue_timeout_s) else None
        self.policy = policy
        self.memory_model = memory_model
        # A path whose engine states its own allocation (the text engine's block-pool KV).
        self.path_models = dict(path_models or {})
        self.headroom_bytes = int(headroom_bytes)
        self.device_bytes = device_bytes
        self.device_source = device_source
        self.poll_interval_s = poll_interval_s
        self._active_memory = active_memory
        self._clock = clock
        self._key = sort_key(policy)
        self._lock = threading.RLock()
        self._seq = itertools.count(1)
        self._running: dict[int, Ticket] = {}
        self._waiting: list[_Waiter] = []
        self._reserved = 0
        self._baseline = int(active_memory())
        # Prefix-cache bytes: resident memory that grows while requests run, after ``baseline`` was
        # measured, so its growth since then counts as used.
        self.cache_bytes: Callable[[], int] = cache_bytes or (lambda: 0)
        self._baseline_cache = 0
        self._admitted = 0
        self._queued_total = 0
        self._completed = 0
        self._cancelled = 0
        self._rejected = dict.fromkeys(_REJECT_REASONS, 0)
        self._waits: deque[float] = deque(maxlen=wait_window)
        self._wait_count = 0
        self._wait_sum = 0.0
        self._run_s_ewma: float | None = None
        self._drain = DrainRate(clock)
        self._burst_log = BurstLog(clock)

    @classmethod
    def from_settings(cls, settings: AdmissionSettings, *, memory_model: MemoryModel | None = None, **kwargs: Any) -> AdmissionController:
        """Build from `cli.AdmissionSettings`."""
        return cls(
            budget_bytes=settings.budget_bytes,
            max_running=settings.max_running,
            max_queue=settings.max_queue,
            queue_timeout_s=settings.queue_timeout_s,
            policy=settings.policy,
            memory_model=memory_model,
            headroom_bytes=settings.headroom_bytes,
            device_bytes=settings.device_bytes,
            device_source=settings.device_source,
            **kwargs,
        )

    # -- public API ---------------------------------------------------------------------------

    def projection(self, prompt_tokens: int, max_tokens: int, extra_bytes: int = 0, path: str = "") -> Projection:
        model = self.path_models.get(path, self.memory_model)
        if model is None:
            return Projection(max(extra_bytes, 0), 0)
        p = model.project_parts(prompt_tokens, max_tokens)
        return Projection(p.persistent_bytes + max(extra_bytes, 0), p.transient_bytes)

    async def acquire(self, *, prompt_tokens: int, max_tokens: int, priority: int = 0,
                      path: str = "text", extra_bytes: int = 0, max_wait_s: float | None = None) -> Ticket:
        """Wait for room and return a Ticket, or raise RequestRejected (413 never fits, 503 busy).

        `priority`: higher runs first under the priority policy. `path` ("text", "media") picks the
        path's own memory model where one was given (``path_models``), else the shared one.
        `extra_bytes` adds memory the model does not know about (e.g. a vision tower's activations).
        `max_wait_s` shortens the queue timeout for this request (e.g. below the server's own request
        timeout, so the wait ends with this controller's 503, not an empty response).
        Cancelling the awaiting task withdraws the request, or releases it if it was just admitted.
        Call on the event loop that serves the request; `Ticket.release()` may come from any thread.
        """
        projection = self.projection(prompt_tokens, max_tokens, extra_bytes, path)
        loop = asyncio.get_running_loop()
        with self._lock:
            request = QueuedRequest(next(self._seq), int(prompt_tokens), int(max_tokens), int(priority))
            limits = [t for t in (self.queue_timeout_s, max_wait_s) if t is not None]
            waiter = _Waiter(request, projection, path, loop, self._clock(), min(limits) if limits else None)
            if not self._running:
                self._baseline, self._baseline_cache = int(self._active_memory()), self.cache_bytes()
            available = self.budget_bytes - self._resident()
            if projection.total_bytes > available:
                self._rejected["too_large"] += 1
                raise RequestRejected(
                    413,
                    f"request needs about {_gib(projection.total_bytes)} ({prompt_tokens} prompt + "
                    f"{max_tokens} max tokens) but at most {_gib(max(available, 0))} of the "
                    f"{_gib(self.budget_bytes)} memory budget can ever be free for it "
                    f"(headroom {_gib(self.headroom_bytes)}); shorten the prompt or lower max_tokens",
                )
            head = not self._waiting or self._key(request) < min(self._key(w.request) for w in self._waiting)
            if head and len(self._running) < self.max_running and self._fits(projection.total_bytes):
                return self._admit(waiter)
            if len(self._waiting) >= self.max_queue:
                self._rejected["queue_full"] += 1
                message = (f"server busy: {len(self._running)} running and {len(self._waiting)} queued "
                           f"(--scheduler-max-queue {self.max_queue}); retry later")
                self._burst_log.refused("queue_full", message)
                raise RequestRejected(503, message, retry_after=self._retry_after())
            self._waiting.append(waiter)
            self._queued_total += 1
        try:
            return await self._wait(waiter)
        except RequestRejected:
            raise
        except BaseException:
            with self._lock:
                if waiter.ticket is not None:
                    waiter.ticket.release()
                elif waiter in self._waiting:
                    self._waiting.remove(waiter)
                    self._dispatch()
                self._cancelled += 1
            raise

    @contextlib.asynccontextmanager
    async def admit(self, **kwargs: Any) -> AsyncIterator[Ticket]:
        """`async with controller.admit(prompt_tokens=..., max_tokens=...) as ticket:`"""
        ticket = await self.acquire(**kwargs)
        try:
            yield ticket
        finally:
            ticket.release()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict[str, Any]:
        """Counters since start and the current state. `queued` is waiting now, `queued_total` ever
        had to wait; queue-wait percentiles (seconds) cover the last `wait_window` admissions,
        immediate ones counting as 0."""
        with self._lock:
            waits = sorted(self._waits)
            live = int(self._active_memory())
            return {
                "policy": self.policy,
                "admitted": self._admitted,
                "completed": self._completed,
                "cancelled": self._cancelled,
                "rejected": sum(self._rejected.values()),
                "rejected_by_reason": dict(self._rejected),
                "queued": len(self._waiting),
                "queued_total": self._queued_total,
                "running": len(self._running),
                "max_running": self.max_running,
                "max_queue": self.max_queue,
                "queue_timeout_s": self.queue_timeout_s,
                "reserved_bytes": self._reserved,
                "baseline_bytes": self._baseline,
                "prefix_cache_bytes": self.cache_bytes(),
                "active_bytes": live,
                "budget_bytes": self.budget_bytes,
                "device_bytes": self.device_bytes,
                "device_source": self.device_source,
                "headroom_bytes": self.headroom_bytes,
                "headroom_gb": round(self.headroom_bytes / GiB, 3),
                "queue_wait_count": self._wait_count,
                "queue_wait_sum_s": self._wait_sum,
                "queue_wait_p50_s": _percentile(waits, 50),
                "queue_wait_p95_s": _percentile(waits, 95),
                "queue_wait_p99_s": _percentile(waits, 99),
            }

    # -- internals (all state changes under self._lock) ------------------------------------------

    async def _wait(self, waiter: _Waiter) -> Ticket:
        deadline = None if waiter.timeout_s is None else waiter.enqueued_at + waiter.timeout_s
        # asyncio.wait, not wait_for: wait_for (3.10/3.11) can swallow a cancellation that races
        # with the wake-up, and a disconnected client's handler would then run anyway.
        woken = asyncio.ensure_future(waiter.event.wait())
        try:
            while waiter.ticket is None:
                timeout = self.poll_interval_s
                if deadline is not None:
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        self._expire(waiter)
                        break
                    timeout = min(timeout, remaining)
                await asyncio.wait({woken}, timeout=timeout)
                if waiter.ticket is None:
                    with self._lock:
                        self._dispatch()
        finally:
            woken.cancel()
        assert waiter.ticket is not None
        return waiter.ticket

    def _expire(self, waiter: _Waiter) -> None:
        with self._lock:
            if waiter.ticket is not None:
                return
            self._waiting.remove(waiter)
            self._rejected["queue_timeout"] += 1
            self._dispatch()
            limit = "--scheduler-queue-timeout" if waiter.timeout_s == self.queue_timeout_s else "the request timeout"
            message = f"server busy: no room for this request within {limit} ({waiter.timeout_s:g}s); retry later"
            self._burst_log.refused("queue_timeout", message)
            raise RequestRejected(503, message, retry_after=self._retry_after())

    def _fits(self, need: int) -> bool:
        live = int(self._active_memory())
        if not self._running:
            self._baseline, self._baseline_cache = live, self.cache_bytes()
        return max(live, self._resident() + self._reserved) + need <= self.budget_bytes

    def _resident(self) -> int:
        return self._baseline + max(0, self.cache_bytes() - self._baseline_cache)

    def _admit(self, waiter: _Waiter) -> Ticket:
        now = self._clock()
        wait = max(now - waiter.enqueued_at, 0.0)
        ticket = Ticket(self, waiter.request, waiter.projection, waiter.path, wait, now)
        self._running[ticket.id] = ticket
        self._reserved += ticket.reserved_bytes
        self._admitted += 1
        self._waits.append(wait)
        self._wait_count += 1
        self._wait_sum += wait
        waiter.ticket = ticket
        return ticket

    def _dispatch(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            head = min(self._waiting, key=lambda w: self._key(w.request))
            if not self._fits(head.projection.total_bytes):
                return
            self._waiting.remove(head)
            self._admit(head)
            _wake(head)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.released:
                return
            self._reserved -= ticket.reserved_bytes
            ticket.released = True
            self._running.pop(ticket.id, None)
            self._completed += 1
            run_s = max(self._clock() - ticket.admitted_at, 0.0)
            self._run_s_ewma = run_s if self._run_s_ewma is None else 0.8 * self._run_s_ewma + 0.2 * run_s
            self._drain.completed()
            self._burst_log.flush()
            self._dispatch()

    def _shrink(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.released or not ticket.transient_bytes:
                return
            self._reserved -= ticket.transient_bytes
            ticket.transient_bytes = 0
            self._dispatch()

    def _retry_after(self) -> float:
        """Seconds until a retry likely finds room: the queue ahead drained at the measured rate."""
        now = self._clock()
        oldest = max((now - t.admitted_at for t in self._running.values()), default=0.0)
        return self._drain.retry_after(len(self._waiting), len(self._running), self._run_s_ewma, oldest)


def _wake(waiter: _Waiter) -> None:
    try:
        on_loop = asyncio.get_running_loop() is waiter.loop
    except RuntimeError:
        on_loop = False
    if on_loop:
        waiter.event.set()
        return
    try:
        waiter.loop.call_soon_threadsafe(waiter.event.set)
    except RuntimeError:  # loop closed: the waiter is gone; its poll or the caller's cleanup releases
        logger.debug("admission waiter's loop is closed", exc_info=True)


def _percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile; 0.0 with no samples."""
    if not sorted_values:
        return 0.0
    rank = max(math.ceil(pct / 100 * len(sorted_values)), 1)
    return sorted_values[rank - 1]


def guard_stream(ticket: Ticket, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Wrap a response body: the ticket is released when the stream ends, fails, is closed on
    client disconnect, or is dropped without ever being iterated."""

    async def body() -> AsyncIterator[Any]:
        try:
            async for item in stream:
                yield item
        finally:
            ticket.release()

    gen = body()
    ticket.bind(gen)
    return gen
