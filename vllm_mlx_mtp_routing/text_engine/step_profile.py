"""Where the slowest recent steps spent their time (``/v1/status``: ``text_engine.slowest_steps``).

A running stream's worst inter-token gap is one step of the text engine: its prefill chunks, the
joins of rows whose prefill finished, and the batch's decode. Step totals alone do not say which of
them made a step long, so each step's parts are kept for a window of recent steps and the slowest
are reported. MLX evaluates lazily: work queued by one part (a join's cache copies) is paid by the
part that next evaluates it, so a part's time is what ran while it ran. ``since_previous_s`` is the
time from the previous step's end to this one's start: the event loop's other work (HTTP, request
preparation); 0 after a step that left no row decoding. Steps are ranked by ``gap_s``, the two
together: how long a running stream waited for this step's token. ``gc_s`` / ``gc_before_s``: the
garbage collector's share of the step and of the time before it (gc_pauses.py).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from .. import gc_pauses


@dataclass
class StepRecord:
    step: int
    rows: int = 0  # decoding rows
    prefill_tokens: int = 0
    chunks: int = 0
    prefill_s: float = 0.0
    longest_chunk_s: float = 0.0
    joins: int = 0
    join_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    since_previous_s: float = 0.0
    gc_s: float = 0.0
    gc_before_s: float = 0.0

    @property
    def gap_s(self) -> float:
        return self.since_previous_s + self.total_s

    def chunk(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens
        self.chunks += 1
        self.prefill_s += seconds
        self.longest_chunk_s = max(self.longest_chunk_s, seconds)

    def as_dict(self) -> dict[str, Any]:
        d = {**asdict(self), "gap_s": self.gap_s}
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


class StepProfile:
    """The last ``window`` steps' records; the ``top`` longest gaps among them on demand."""

    def __init__(self, window: int = 256, top: int = 5) -> None:
        self._recent: deque[StepRecord] = deque(maxlen=window)
        self._top = top
        self.current: StepRecord | None = None
        self._started = 0.0
        self._ended = 0.0
        self._gc_at_start = 0.0
        self._gc_at_end = 0.0

    def begin(self, step: int) -> StepRecord:
        self._started = time.perf_counter()
        self._gc_at_start = gc_pauses.collection_s()
        self.current = StepRecord(step, since_previous_s=self._started - self._ended if self._ended else 0.0)
        if self._ended:
            self.current.gc_before_s = self._gc_at_start - self._gc_at_end
        return self.current

    def end(self, streams_waiting: bool) -> None:
        """``streams_waiting``: rows still decode after this step, so the time until the next one is a
        gap someone sees (after a step that leaves none, the wait for new work is nobody's gap)."""
        if self.current is not None:
            now = time.perf_counter()
            self._ended = now if streams_waiting else 0.0
            self._gc_at_end = gc_pauses.collection_s()
            self.current.total_s = now - self._started
            self.current.gc_s = self._gc_at_end - self._gc_at_start
            self._recent.append(self.current)
            self.current = None

    def slowest(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in heapq.nlargest(self._top, self._recent, key=lambda r: r.gap_s)]
