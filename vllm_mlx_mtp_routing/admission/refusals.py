"""How busy refusals are told: Retry-After from the measured drain rate, and one log line per burst.

Drain rate: requests finished per second, from the completions of the last ``WINDOW_S`` seconds;
without two recent completions, the running slots over the mean run time; with no history at all,
the age of the oldest running request (it has run at least that long). A client retrying after
``(queued + 1) / rate`` seconds finds the queue ahead of it drained at that rate.

Logging: a 503 is the server working as designed, not an error. The first refusal of a burst is one
INFO line; the rest are counted and summed up in one line when the burst is over (no refusal for
``BURST_GAP_S``), so a flood of refusals does not flood the log.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable

logger = logging.getLogger("vllm_mlx_mtp_routing.admission")

WINDOW_S = 30.0
BURST_GAP_S = 5.0
MAX_RETRY_AFTER_S = 600


class DrainRate:
    def __init__(self, clock: Callable[[], float], window: int = 256) -> None:
        self._clock = clock
        self._done: deque[float] = deque(maxlen=window)

    def completed(self) -> None:
        self._done.append(self._clock())

    def per_second(self) -> float | None:
        now = self._clock()
        recent = [t for t in self._done if now - t <= WINDOW_S]
        if len(recent) < 2 or recent[-1] <= recent[0]:
            return None
        # n completions span n-1 intervals; counting to now keeps a stalled drain from looking fast
        return (len(recent) - 1) / max(now - recent[0], recent[-1] - recent[0])

    def retry_after(self, queued: int, running: int, mean_run_s: float | None, oldest_running_s: float) -> float:
        rate = self.per_second()
        if rate is None and mean_run_s:
            rate = max(running, 1) / mean_run_s
        if rate is None or rate <= 0:
            return float(min(max(math.ceil(oldest_running_s), 1), MAX_RETRY_AFTER_S))
        return float(min(max(math.ceil((queued + 1) / rate), 1), MAX_RETRY_AFTER_S))


class BurstLog:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._first = 0.0
        self._last = -math.inf
        self._count: Counter[str] = Counter()

    def refused(self, reason: str, detail: str) -> None:
        now = self._clock()
        self.flush(now)
        if not self._count:
            self._first = now
            logger.info("Refusing requests (%s): %s; further refusals of this burst are counted", reason, detail)
        self._count[reason] += 1
        self._last = now

    def flush(self, now: float | None = None) -> None:
        """Log the finished burst's count, if a burst ended (call whenever convenient)."""
        now = self._clock() if now is None else now
        if self._count and now - self._last >= BURST_GAP_S:
            total = sum(self._count.values())
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(self._count.items()))
            logger.info("Refusal burst over: %d requests refused in %.1fs (%s)", total, self._last - self._first, reasons)
            self._count.clear()
