"""What a drafting step costs against a plain one, per batch-size bucket, learned from the engine's
own steps.

A bucket (batch 1, 2, 3-4, 5-8, ...) starts by alternating blocks of ``block`` timed steps: drafting
(k drafts), then plain, ``pairs`` times each. Each block's median step time is divided by its
neighbouring block of the other kind, and the bucket's cost ratio r = t_draft / t_plain is the
median of those ratios. Neighbouring blocks are seconds apart, so a slow phase of the machine (a
busy host thread, another process) falls on both sides of most ratios. After that the ratio is
fixed for the server's life: it is a property of the model, the device and the batch size, where
acceptance (which the policy tracks per row) is a property of the text.

The caller decides which steps are timed: a step that compiles or plans a new shape, follows a
switch of draft count, a join or a leave, or resumes the MTP head after plain steps is a one-off.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def bucket_of(batch: int) -> int:
    return 1 << (batch - 1).bit_length()  # 1, 2, 4, 8, ...: nearby sizes share a measurement


@dataclass
class _Bucket:
    drafting: bool = True  # the arm of the block being timed (drafting first: the head's caches warm)
    times: list[float] = field(default_factory=list)  # the block's timed steps so far
    blocks: list[tuple[bool, float]] = field(default_factory=list)  # (drafting, median seconds)
    ratio: float | None = None


class DraftCosts:
    def __init__(self, *, block: int = 3, pairs: int = 3, known: dict[int, float] | None = None) -> None:
        """``known``: ratios measured elsewhere, per bucket (``bucket_of(batch)``); not learned again."""
        self.block = block
        self.pairs = pairs
        self._buckets = {b: _Bucket(ratio=r) for b, r in (known or {}).items()}

    def _bucket(self, batch: int) -> _Bucket:
        return self._buckets.setdefault(bucket_of(batch), _Bucket())

    def ratio(self, batch: int) -> float | None:
        """t_draft / t_plain for this batch size, None while it is being learned."""
        return self._bucket(batch).ratio

    def learning_arm(self, batch: int) -> bool | None:
        """While the bucket learns: whether its next step should draft; None once learned."""
        b = self._bucket(batch)
        return None if b.ratio is not None else b.drafting

    def record(self, batch: int, drafted: bool, seconds: float) -> None:
        """A timed steady step of ``batch`` rows, drafting or not."""
        b = self._bucket(batch)
        if b.ratio is not None or drafted != b.drafting:
            return
        b.times.append(seconds)
        if len(b.times) < self.block:
            return
        b.blocks.append((b.drafting, statistics.median(b.times)))
        b.times, b.drafting = [], not b.drafting
        if len(b.blocks) == 2 * self.pairs:
            # Each block against its neighbour of the other kind: draft / plain.
            ratios = [(x / y if dx else y / x) for (dx, x), (_, y) in zip(b.blocks, b.blocks[1:])]
            b.ratio = statistics.median(ratios)

    def ratio_by_batch(self) -> dict[int, float | None]:
        return {k: None if b.ratio is None else round(b.ratio, 3) for k, b in sorted(self._buckets.items())}
