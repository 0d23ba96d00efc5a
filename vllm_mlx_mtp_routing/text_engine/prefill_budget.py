"""A step's prefill bounded by time, with chunks sized from throughput measured once at start
(as Sarathi-Serve sizes its token budget from a profile).

Text steps run on the event-loop thread and a step's prefill runs before its decode, so the running
streams' inter-token gap and ``/health``'s latency are at most one step: one decode plus the step's
prefill. ``--prefill-step-size`` bounds that prefill in tokens only; on a CPU, or with a large model,
a 2048-token chunk is seconds to a minute. So at start the engine times a decode step and two prefill
chunk sizes on the loaded model (a cost of a + b * tokens per chunk) and takes

- the chunk: the largest whose projected time stays within ``ratio`` decode steps
  (``--prefill-stall-ratio``), capped by ``--prefill-step-size``;
- per step, chunks while the step's prefill time stays within ``ratio`` times the running batch's
  own decode step (measured every step: it grows with the batch and with load on the machine; at
  least one chunk), or within ``IDLE_STEP_S`` when no row is decoding (a lone prompt goes at full
  speed and ``/health`` still answers between steps), never more than ``--prefill-step-size`` tokens.

The chunk is fixed for the server's life and only the number of chunks per step follows the clock:
a prompt's chunk boundaries depend on nothing but the prompt and the server, which keeps a request's
output the same alone or in any batch (the engine's exactness; see batch.py). Attention cost grows
with the position, so chunks deep into a long prompt take somewhat longer than the estimate.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

logger = logging.getLogger(__name__)

MIN_CHUNK = 16
IDLE_STEP_S = 0.25
# Small probes: start-up pays ~(3 x 8 + 3 x 24) prompt tokens (more where 24 tokens cost no more than 8, see calibrate). Where prefill is slow (a quantized model on
# MLX's CPU backend: ~64 ms a token) larger probes cost the start-up tens of seconds.
PROBE_SMALL = 8
PROBE_LARGE = 24
DEFAULT_RATIO = 3.0


@dataclass(frozen=True)
class PrefillBudget:
    chunk_tokens: int
    max_chunk_tokens: int  # --prefill-step-size
    ratio: float
    decode_step_s: float
    chunk_fixed_s: float  # a: the per-chunk cost that does not grow with its tokens
    per_token_s: float  # b
    calibration_s: float
    probe_tokens: int = PROBE_LARGE  # the larger calibration probe (grown where 24 tokens cost no more than 8)
    stored_at: str | None = None  # when it was measured, if read from --prefill-calibration-file (calibration_file.py)

    @property
    def target_s(self) -> float:
        return self.ratio * self.decode_step_s

    @property
    def bounded(self) -> bool:
        return self.ratio > 0 and self.decode_step_s > 0

    def apply(self, scheduler: Any) -> None:
        """Make ``scheduler`` (a BatchScheduler) prefill in these chunks within these step times."""
        if self.bounded:
            scheduler.prefill_chunk = self.chunk_tokens
            scheduler.prefill_time_s = (self.ratio, max(IDLE_STEP_S, self.target_s))

    def stats(self) -> dict[str, Any]:
        return {**asdict(self), "target_s": self.target_s}


def _seconds(fn: Any, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return times


def median_seconds(fn: Any, repeats: int) -> float:
    return statistics.median(_seconds(fn, repeats))


def fastest_seconds(fn: Any, repeats: int) -> float:
    return min(_seconds(fn, repeats))


def calibrate(model: nn.Module, *, max_chunk: int, ratio: float, vocab_size: int, seed: int = 0) -> PrefillBudget:
    """Measure on ``model`` (on the thread that owns it) and choose the chunk; ``ratio <= 0``: no bound."""
    if ratio <= 0 or max_chunk <= MIN_CHUNK:
        return PrefillBudget(max_chunk, max_chunk, ratio, 0.0, 0.0, 0.0, 0.0)
    tic = time.perf_counter()
    ids = mx.random.randint(0, max(vocab_size, 2), (1, max(max_chunk, PROBE_LARGE) + 8), key=mx.random.key(seed))
    mx.eval(ids)

    def forward(cache: list[Any], tokens: mx.array) -> None:
        mx.eval(model(tokens, cache=cache))

    def prefill(n: int) -> None:
        forward(model.make_cache(), ids[:, :n])

    def timed_prefill(n: int) -> float:
        prefill(n)  # warm-up per shape: first-call compilation and buffer allocation
        # The faster of two: noise only ever adds time, and one slow probe (a GPU still planning or
        # clocking up at start-up) read into the median of two made the chunk 80 tokens on one start
        # of an H100 server and 368-1536 on others (BENCHMARKS.md section 7).
        return fastest_seconds(lambda: prefill(n), 2)

    small = timed_prefill(PROBE_SMALL)
    probe_large = PROBE_LARGE
    large = timed_prefill(probe_large)
    # Where a token costs little against a chunk's fixed cost (a GPU: ~30 us a token beside ~10 ms of launches),
    # 24 tokens do not move the clock and the per-token cost would read as zero, letting the chunk grow to
    # --prefill-step-size: grow the probe until it costs visibly more than the small one.
    while large < 1.5 * small and probe_large * 4 <= max_chunk:
        probe_large *= 4
        large = timed_prefill(probe_large)
    cache = model.make_cache()
    forward(cache, ids[:, :PROBE_SMALL])
    position = [PROBE_SMALL]

    def decode() -> None:
        forward(cache, ids[:, position[0] : position[0] + 1])
        position[0] += 1

    decode()
    decode_s = median_seconds(decode, 5)
    per_token = max((large - small) / (probe_large - PROBE_SMALL), 1e-9)
    fixed = max(small - per_token * PROBE_SMALL, 0.0)
    target = ratio * decode_s
    fit = int((target - fixed) / per_token) if target > fixed else 0
    chunk = min(max_chunk, max(MIN_CHUNK, fit // MIN_CHUNK * MIN_CHUNK))
    budget = PrefillBudget(chunk, max_chunk, ratio, decode_s, fixed, per_token, time.perf_counter() - tic, probe_large)
    logger.info(
        "mtp-routing: text prefill chunk %d tokens (a decode step %.1f ms; a chunk ~%.1f ms + %.3f ms/token; "
        "target %.1f ms = %g decode steps; --prefill-step-size %d; measured in %.1f s)",
        chunk, decode_s * 1e3, fixed * 1e3, per_token * 1e3, target * 1e3, ratio, max_chunk, budget.calibration_s,
    )
    return budget


def more_prefill(scheduler: Any, tokens_after: int, started: float, last_chunk_s: float) -> bool:
    """May this step run another prefill chunk (``tokens_after`` tokens in all, ``started`` its first)?"""
    if tokens_after > scheduler.prefill_step_size:
        return False
    limits = getattr(scheduler, "prefill_time_s", None)
    if limits is None:
        return True
    if scheduler.running:
        limit = limits[0] * (getattr(scheduler, "decode_step_s", 0.0) or 0.0)
    else:
        limit = limits[1]
    return time.perf_counter() - started + last_chunk_s <= limit


def note_decode_step(scheduler: Any, seconds: float) -> None:
    """Keep a smoothed decode-step time of the running batch for ``more_prefill``."""
    previous = getattr(scheduler, "decode_step_s", 0.0) or 0.0
    scheduler.decode_step_s = seconds if not previous else 0.7 * previous + 0.3 * seconds
