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

Attention's cost grows with the position: on a CPU a small chunk deep in a long prompt costs a
multiple of one at its start, enough alone to blow one step's gap.
So the calibration also times a chunk over a cache 2K-8K positions deep (keys written, not
prefilled: what attention costs does not depend on their values) for the attention's share, ``c``
seconds per token per position it reads, and a chunk's projected time is ``a + b * n + c * n *
(position + n / 2)``. Chunks shrink with the position (as Medha's adaptive chunking does for long contexts) so
that none is projected past the chunk limit: ``ratio`` decode steps, or where even the smallest
regular chunk (``MIN_CHUNK`` tokens) costs more, that chunk's time at the prompt's start; deep in a
prompt on a slow device a chunk may be a few tokens.

Chunk boundaries are fixed for the server's life (``ChunkGrid``: a function of the position only)
and only the number of chunks per step follows the clock: a prompt's chunks depend on nothing but
the prompt and the server, which keeps a request's output the same alone or in any batch (the
engine's exactness; see batch.py), and a prompt resumed from a prefix-cache snapshot meets the
boundaries it would have met from its start.

Where the device computes a prompt's state the same whatever its chunks (``chunk_exact``: probed at
start, bitwise, by prefilling one prompt in several different chunkings; MLX's CPU backend is, its
GPU kernels pick tiles and paths by shape), the grid is kept only while rows decode: a prompt
prefilled while nothing else runs takes chunks sized from its last chunk's measured CPU time to take
about ``IDLE_CHUNK_S`` (``idle_chunk_at``; the projection above is a bound, and deep in a prompt it runs
several times over; CPU seconds, so that other work on the machine does not shrink them), so a lone
prompt pays no per-chunk cost for a stall bound no stream needs, and its output is still the same
alone or batched.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..model import layered_forward
from ..model.mlx_lm_internals import KVCache

logger = logging.getLogger(__name__)

MIN_CHUNK = 16
IDLE_STEP_S = 0.25
# A lone prompt's chunk where chunking is exact: long enough that a chunk's fixed cost is noise (~1%), short enough
# that /health and a new request's admission wait about this long at most (the host: one 1024-token chunk).
IDLE_CHUNK_S = 2.0
# The chunkings of one probe prompt compared bitwise (chunk_exact): one forward, growing chunks from one token, halves,
# odd sizes (a kernel picked by shape changes at sizes like these).
EXACT_PROBE = ((64,), (1, 2, 3, 5, 8, 13, 32), (32, 32), (7, 57))
# Small probes: start-up pays ~(3 x 8 + 3 x 24) prompt tokens (more where 24 tokens cost no more than 8, see calibrate). Where prefill is slow (a quantized model on
# MLX's CPU backend) larger probes would cost the start-up tens of seconds.
PROBE_SMALL = 8
PROBE_LARGE = 24
# The attention probe's cache doubles from MIN until a chunk there costs VISIBLE x one at the start;
# under VISIBLE_AT_ALL x at MAX the attention's share is taken for noise (a GPU, at these depths).
# Its keys are held only while it is timed (at MAX, 8K positions of every attention layer's KV).
PROBE_DEPTH_MIN, PROBE_DEPTH_MAX = 2048, 8192
VISIBLE, VISIBLE_AT_ALL = 1.25, 1.1
DECODE_WARMUP, DECODE_PROBES = 3, 7
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
    attention_s: float = 0.0  # c: per chunk token per position it attends to
    probe_depth: int = 0  # where c was measured (0: not measured; chunks do not shrink with the position)
    chunk_exact: bool = False  # the probe found a prompt's state the same whatever its chunks
    # Per decoder layer, is it full attention: a chunk may then run in pieces of layers across steps (empty: whole)
    layer_kinds: tuple[bool, ...] = ()

    @property
    def target_s(self) -> float:
        return self.ratio * self.decode_step_s

    @property
    def chunk_limit_s(self) -> float:
        """No chunk is projected past this: the target, or a ``MIN_CHUNK``-token chunk's time at position 0."""
        return max(self.target_s, self.chunk_s(MIN_CHUNK, 0))

    def chunk_s(self, tokens: int, position: int) -> float:
        """The projected time of a chunk of ``tokens`` starting at prompt ``position``."""
        return self.chunk_fixed_s + tokens * (self.per_token_s + self.attention_s * (position + tokens / 2))

    def chunk_at(self, position: int) -> int:
        """The chunk that starts at ``position``: the largest within the limit (a multiple of ``MIN_CHUNK``
        from there up), at most ``chunk_tokens``, at least one token."""
        if not self.bounded or self.attention_s <= 0:
            return self.chunk_tokens
        limit = self.chunk_limit_s
        n = _largest(1, self.chunk_tokens, lambda m: self.chunk_s(m, position) <= limit)
        return n if n < MIN_CHUNK else n // MIN_CHUNK * MIN_CHUNK

    def layer_s(self, tokens: int, position: int) -> list[float]:
        """The projected time of each decoder layer of a chunk: its fixed and per-token cost spread evenly over the
        layers, its attention's cost over the full-attention layers."""
        kinds = self.layer_kinds or (True,)
        even = (self.chunk_fixed_s + tokens * self.per_token_s) / len(kinds)
        attention = self.attention_s * tokens * (position + tokens / 2) / max(sum(kinds), 1)
        return [even + (attention if full else 0.0) for full in kinds]

    def grid_chunk_at(self, position: int) -> int:
        """The grid's chunk at ``position`` where a chunk may run in pieces of layers (``layer_kinds``): the largest
        whose heaviest layer is projected within the limit, at most ``--prefill-step-size`` (the host's chunk), never
        below ``chunk_at``; else ``chunk_at``."""
        least = self.chunk_at(position)
        if len(self.layer_kinds) < 2 or not self.bounded:
            return least
        limit = self.chunk_limit_s
        n = _largest(least, max(least, self.max_chunk_tokens), lambda m: max(self.layer_s(m, position)) <= limit)
        return n if n < MIN_CHUNK else n // MIN_CHUNK * MIN_CHUNK

    def piece_end(self, position: int, tokens: int, first: int, scale: float = 1.0, spent_s: float = 0.0) -> int:
        """Where a piece of the chunk of ``tokens`` at ``position`` that starts at layer ``first`` ends: as many layers
        as are projected within what the limit leaves after ``spent_s`` (this step's prefill so far), at least one;
        ``scale``: measured over projected seconds of recent pieces."""
        costs = self.layer_s(tokens, position)
        limit = max(self.chunk_limit_s - spent_s, 0.0) / max(scale, 1e-6)
        end, total = first + 1, costs[first]
        while end < len(costs) and total + costs[end] <= limit:
            total += costs[end]
            end += 1
        return end

    def piece_s(self, position: int, tokens: int, first: int, end: int) -> float:
        """The projected seconds of layers ``first`` to ``end`` of that chunk."""
        return sum(self.layer_s(tokens, position)[first:end])

    def idle_chunk_at(self, position: int, seconds_per_token: float = 0.0) -> int:
        """The chunk at ``position`` while no row decodes (``chunk_exact`` only): about ``IDLE_CHUNK_S`` at
        ``seconds_per_token`` (the prompt's last chunk, measured; 0: the largest projected within it), a multiple of
        ``MIN_CHUNK``, at most ``--prefill-step-size``, never below ``chunk_at``."""
        least = self.chunk_at(position)
        if seconds_per_token > 0:
            n = int(IDLE_CHUNK_S / seconds_per_token)
        else:
            n = _largest(least, self.max_chunk_tokens, lambda m: self.chunk_s(m, position) <= IDLE_CHUNK_S)
        n = min(n if n < MIN_CHUNK else n // MIN_CHUNK * MIN_CHUNK, self.max_chunk_tokens)
        return max(n, least)

    @property
    def bounded(self) -> bool:
        return self.ratio > 0 and self.decode_step_s > 0

    def apply(self, scheduler: Any) -> None:
        """Make ``scheduler`` (a BatchScheduler) prefill in these chunks within these step times."""
        if self.bounded:
            scheduler.prefill_chunk = self.chunk_tokens
            if len(self.layer_kinds) > 1:  # large chunks, run in pieces of layers while rows decode
                scheduler.chunk_grid = ChunkGrid(self.grid_chunk_at)
                scheduler.layer_pieces = self
            else:
                scheduler.chunk_grid = ChunkGrid(self.chunk_at) if self.attention_s > 0 else None
            scheduler.idle_chunk = self.idle_chunk_at if self.chunk_exact else None
            scheduler.prefill_time_s = (self.ratio, max(IDLE_STEP_S, self.target_s))

    def stats(self) -> dict[str, Any]:
        depths = [1024, 4096, 16384, 65536]
        return {**asdict(self), "target_s": self.target_s, "chunk_limit_s": self.chunk_limit_s,
                "chunk_at": {str(p): self.chunk_at(p) for p in depths},
                "grid_chunk_at": {str(p): self.grid_chunk_at(p) for p in depths},
                "idle_chunk_at": {str(p): self.idle_chunk_at(p) for p in depths} if self.chunk_exact else None}


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [lo, hi] that ``fits`` (which holds up to some n and not past it; lo where none does): the
    projections grow with the tokens, so bisect."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


class ChunkGrid:
    """Where prompt chunks end: 0, then each end plus the chunk that starts there, so a prefill that
    starts anywhere (a snapshot's position) meets the same ends as one from the prompt's start."""

    def __init__(self, chunk_at: Any) -> None:
        self._chunk_at = chunk_at
        self._ends = array("q", [0])

    def next_end(self, start: int) -> int:
        """The first chunk end after ``start``."""
        while self._ends[-1] <= start:
            self._ends.append(self._ends[-1] + self._chunk_at(self._ends[-1]))
        return self._ends[bisect.bisect_right(self._ends, start)]


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
    ids = mx.random.randint(0, max(vocab_size, 2), (1, max(max_chunk, PROBE_LARGE, sum(EXACT_PROBE[0]) + 1) + 8), key=mx.random.key(seed))
    mx.eval(ids)

    def forward(cache: list[Any], tokens: mx.array) -> None:
        mx.eval(model(tokens, cache=cache))

    def prefill(n: int) -> None:
        forward(model.make_cache(), ids[:, :n])

    def timed_prefill(n: int) -> float:
        prefill(n)  # warm-up per shape: first-call compilation and buffer allocation
        # The faster of two: noise only ever adds time, and one slow probe (a GPU still planning or
        # clocking up at start-up) read into a median would shrink the chunk several times over.
        return fastest_seconds(lambda: prefill(n), 2)

    small = timed_prefill(PROBE_SMALL)
    probe_large = PROBE_LARGE
    large = timed_prefill(probe_large)
    # Where a token costs little against a chunk's fixed cost (a GPU: a chunk's launches outweigh its tokens),
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

    for _ in range(DECODE_WARMUP):
        decode()
    # The median of several after a few untimed: a GPU's first steps run slow (a budget from them is too
    # large), and its fastest undercuts what a step takes once serving (a budget from it is too small: the
    # chunk shrinks with it, and a long prompt's first token comes later).
    decode_s = median_seconds(decode, DECODE_PROBES)
    per_token = max((large - small) / (probe_large - PROBE_SMALL), 1e-9)
    fixed = max(small - per_token * PROBE_SMALL, 0.0)
    attention, depth = _attention_cost(model, forward, ids, probe_large, large)
    exact = chunking_is_exact(model, ids)
    target = ratio * decode_s
    fit = int((target - fixed) / per_token) if target > fixed else 0
    chunk = min(max_chunk, max(MIN_CHUNK, fit // MIN_CHUNK * MIN_CHUNK))
    budget = PrefillBudget(chunk, max_chunk, ratio, decode_s, fixed, per_token, time.perf_counter() - tic, probe_large,
                           attention_s=attention, probe_depth=depth, chunk_exact=exact, layer_kinds=_layer_kinds(model))
    budget = replace(budget, chunk_tokens=budget.chunk_at(0))  # its own attention counted too
    logger.info(
        "mtp-routing: text prefill chunk %d tokens, %d at position 16384%s (a decode step %.1f ms; a chunk ~%.1f ms + "
        "%.3f ms/token + %.2f us/token/position; target %.1f ms = %g decode steps; --prefill-step-size %d; "
        "measured in %.1f s); %s",
        budget.grid_chunk_at(0), budget.grid_chunk_at(16384),
        ", run in pieces of layers while rows decode" if len(budget.layer_kinds) > 1 else "", decode_s * 1e3, fixed * 1e3, per_token * 1e3, attention * 1e6, target * 1e3,
        ratio, max_chunk, budget.calibration_s,
        f"chunking is exact here: a lone prompt's chunk {budget.idle_chunk_at(0)} tokens, {budget.idle_chunk_at(16384)} "
        "at position 16384" if exact else "chunking changes numerics here: every prompt keeps the chunk grid",
    )
    return budget


def _layer_kinds(model: nn.Module) -> tuple[bool, ...]:
    try:
        return layered_forward.layer_kinds(model)
    except AttributeError:  # not mlx-lm's decoder stack: whole chunks
        return ()


def chunking_is_exact(model: nn.Module, ids: mx.array) -> bool:
    """Is a prompt's state (every cache array, the next token's logits) bitwise the same whatever its chunks, for
    each chunking of ``EXACT_PROBE``?"""
    reference: list[mx.array] | None = None
    for chunks in EXACT_PROBE:
        cache, position = model.make_cache(), 0
        for n in chunks:
            model(ids[:, position : position + n], cache=cache)
            mx.eval([c.state for c in cache])
            position += n
        logits = model(ids[:, position : position + 1], cache=cache)
        arrays = [logits, *(_held(c) for c in cache)]
        mx.eval(arrays)
        if reference is None:
            reference = arrays
        elif not all(mx.array_equal(a, b).item() for a, b in zip(arrays, reference)):
            return False
    return True


def _held(cache: Any) -> mx.array:
    """A cache's state as one array: an attention layer's keys and values up to its offset (its buffer is reserved
    in steps), a gated-delta layer's conv and recurrent state."""
    if isinstance(cache, KVCache):
        assert cache.keys is not None and cache.values is not None  # the probe prefilled it
        parts = [cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]]
    else:
        parts = [x for x in cache.state if x is not None]
    return mx.concatenate([p.astype(mx.float32).reshape(-1) for p in parts])


def _attention_cost(model: nn.Module, forward: Any, ids: mx.array, tokens: int, shallow: float) -> tuple[float, int]:
    """Attention's share of a chunk's time, per chunk token per position read, and the depth it was
    read at: a chunk of ``tokens`` (``shallow`` seconds at the start) timed over a cache made deeper
    until it costs visibly more (0, 0: no visible difference by ``PROBE_DEPTH_MAX``, or no attention)."""
    cache = model.make_cache()
    forward(cache, ids[:, :PROBE_SMALL])
    layers = [c for c in cache if isinstance(c, KVCache) and c.keys is not None]
    if not layers:
        return 0.0, 0

    def chunk() -> None:
        forward(cache, ids[:, :tokens])  # noqa: F821 - the `del` below runs after the last call
        for c in layers:  # noqa: F821
            c.trim(tokens)  # back to the probe's depth (the gated-delta state moves on: its cost does not)

    depth = PROBE_DEPTH_MIN
    while True:
        deep_cache(layers, depth)
        chunk()  # the first chunk at a depth pays the cache's growth
        deep = fastest_seconds(chunk, 2)
        if deep >= VISIBLE * shallow or depth >= PROBE_DEPTH_MAX:
            break
        depth *= 2
    del cache, layers
    mx.clear_cache()
    if deep < VISIBLE_AT_ALL * shallow:
        return 0.0, 0
    return (deep - shallow) / (tokens * depth), depth


def deep_cache(layers: list[Any], depth: int) -> None:
    """Append random keys and values to attention caches until they hold ``depth`` positions: what a
    chunk's attention costs depends on how many it reads, not on their values."""
    for c in layers:
        _, heads, _, dim = c.keys.shape
        if depth > c.offset:
            filler = mx.random.normal((1, heads, depth - c.offset, dim), key=mx.random.key(1)).astype(c.keys.dtype)
            c.update_and_fetch(filler, filler)
    mx.eval([c.state for c in layers])


def step_limit_s(scheduler: Any) -> float | None:
    """A step's prefill seconds: ``ratio`` times the running batch's decode step while rows decode, else the idle
    bound; None where no time limit is set."""
    limits = getattr(scheduler, "prefill_time_s", None)
    if limits is None:
        return None
    if scheduler.running:
        return limits[0] * (getattr(scheduler, "decode_step_s", 0.0) or 0.0)
    return limits[1]


def more_prefill(scheduler: Any, tokens_after: int, started: float, next_s: float) -> bool:
    """May this step run another prefill item (``tokens_after`` tokens in all, ``started`` its first) expected to take
    ``next_s``?"""
    if tokens_after > scheduler.prefill_step_size:
        return False
    limit = step_limit_s(scheduler)
    return limit is None or time.perf_counter() - started + next_s <= limit


def note_decode_step(scheduler: Any, seconds: float) -> None:
    """Keep a smoothed decode-step time of the running batch for ``more_prefill``."""
    previous = getattr(scheduler, "decode_step_s", 0.0) or 0.0
    scheduler.decode_step_s = seconds if not previous else 0.7 * previous + 0.3 * seconds
