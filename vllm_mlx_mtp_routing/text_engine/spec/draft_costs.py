"""What a drafting step costs against a plain one, per batch-size bucket, learned from the engine's
own steps.

A bucket (batch 1, 2, 3-4, 5-8, ...) measures in sessions: blocks of ``block`` timed steps that
alternate between drafting (k drafts) and plain, ``pairs`` blocks of each. Each block's median step
time is divided by its neighbouring block's of the other kind (seconds apart, so a slow phase of
the machine, a busy host thread or another process, falls on both sides of most ratios), and the
bucket's cost ratio r = t_draft / t_plain is the median of its last ``keep`` such ratios. The first
session runs when the bucket is first met; later ones only when the policy asks (``refine``: its
choice is within two standard errors of r of a tie, so r's error could flip it), so each adds
ratios where they matter and r converges there until the choice is clear, while a bucket with a
clear answer is never measured again.

The caller decides which steps are timed: a step that compiles or plans a new shape, follows a
switch of draft count, a join or a leave, or resumes the MTP head after plain steps is a one-off.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


def bucket_of(batch: int) -> int:
    return 1 << (batch - 1).bit_length()  # 1, 2, 4, 8, ...: nearby sizes share a measurement


@dataclass
class _Bucket:
    ratios: deque
    session: int = 0  # blocks the running session still needs; 0: none running
    drafting: bool = True  # the arm of the block being timed (drafting first: the head's caches warm)
    times: list[float] = field(default_factory=list)  # the block's timed steps so far
    waited: int = 0  # steps the block has run
    last: tuple[bool, float] | None = None  # the session's previous block: (drafting, median seconds)
    # (ratio, uncertainty) of ``ratios`` as last computed: the policy asks every step, the ratios change
    # only when a block ends, and statistics.stdev (exact arithmetic) is a visible share of a small step
    summary: tuple[float | None, float] | None = None


class DraftCosts:
    def __init__(self, *, block: int = 3, pairs: int = 3, keep: int = 32, known: dict[int, float] | None = None) -> None:
        """``known``: ratios measured elsewhere, per bucket (``bucket_of(batch)``)."""
        self.block = block
        self.pairs = pairs
        self.keep = keep
        self._buckets: dict[int, _Bucket] = {}
        for b, r in (known or {}).items():
            self._bucket(b).ratios.append(r)
            self._bucket(b).summary = None
            self._bucket(b).session = 0

    def _bucket(self, batch: int) -> _Bucket:
        b = bucket_of(batch)
        if b not in self._buckets:
            self._buckets[b] = _Bucket(deque(maxlen=self.keep), session=2 * self.pairs)
        return self._buckets[b]

    def ratio(self, batch: int) -> float | None:
        """t_draft / t_plain for this batch size; None until a first session has measured it."""
        b = self._bucket(batch)
        if b.session and not b.ratios:
            return None
        return self._summary(b)[0]

    def uncertainty(self, batch: int) -> float:
        """The relative standard error of ``ratio`` (its ratios' spread over the root of their count)."""
        return self._summary(self._bucket(batch))[1]

    @staticmethod
    def _summary(b: _Bucket) -> tuple[float | None, float]:
        if b.summary is None:
            r = b.ratios
            median = statistics.median(r) if r else None
            spread = statistics.stdev(r) / len(r) ** 0.5 / median if len(r) >= 2 else float("inf")
            b.summary = (median, spread)
        return b.summary

    def learning_arm(self, batch: int) -> bool | None:
        """While a session runs: whether the bucket's next step should draft; None otherwise."""
        b = self._bucket(batch)
        if not b.session and not b.ratios:
            self.refine(batch)  # a session whose every block was cut short measured no ratio: measure again
        if not b.session:
            return None
        b.waited += 1
        if b.waited > 4 * (self.block + 1):
            # Too few steady steps (rows join and leave all the time): the block starts again on
            # the other arm, unpaired, instead of holding one arm as long as the load lasts.
            b.drafting, b.times, b.last, b.waited = not b.drafting, [], None, 1
        return b.drafting

    def refine(self, batch: int) -> None:
        """Measure this bucket again (the policy's choice there is close to a tie)."""
        b = self._bucket(batch)
        if not b.session:
            b.session, b.drafting, b.times, b.last, b.waited = 2 * self.pairs, True, [], None, 0

    def record(self, batch: int, drafted: bool, seconds: float) -> None:
        """A timed steady step of ``batch`` rows, drafting or not."""
        b = self._bucket(batch)
        if not b.session or drafted != b.drafting:
            return
        b.times.append(seconds)
        if len(b.times) < self.block:
            return
        block = (b.drafting, statistics.median(b.times))
        if b.last is not None:  # against its neighbour of the other kind: draft / plain
            (dx, x), (_, y) = b.last, block
            b.ratios.append(x / y if dx else y / x)
            b.summary = None
        b.last, b.times, b.drafting, b.session, b.waited = block, [], not b.drafting, b.session - 1, 0

    def ratio_by_batch(self) -> dict[int, float | None]:
        out = {}
        for k in sorted(self._buckets):
            r = self.ratio(k)
            out[k] = None if r is None else round(r, 3)
        return out
