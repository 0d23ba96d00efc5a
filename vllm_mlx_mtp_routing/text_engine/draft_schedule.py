"""How many tokens to draft this step (0..k), chosen from measured throughput per batch size.

Each batch-size bucket (1, 2, 3-4, 5-8, ...) keeps one ``Arm`` per draft count: its recent step
times and tokens per row-step. Decisions compare arms measured back to back: every ``interval``
steps the stalest other arm runs for ``explore_steps`` timed steps (and at least ``explore_rows``
row-steps, for a yield that is not one coin) and is judged against the current arm's latest steps,
timed just before it, so a slow phase of the machine (another process, a busy host thread: on a
launch-bound GPU every step slows 3-4x for a second or two) weighs on both sides alike instead of
on whichever arm happened to be timed then. A challenger must beat the current arm by ``margin``.
Each confirmation doubles the interval, up to ``max_explore_every``: near a tie a wrong choice
costs little and each exploration costs the MTP head a catch-up. A switch to fewer drafts quarters
it instead, since nothing measures the drafts' acceptance while they are off, and a switch made in
a passing dip of acceptance (a request's first tokens) must not hold for hundreds of steps; a
clearly better arm (``reset_gain``) resets it. When the current arm's own rate falls below what it
was last confirmed at by more than ``reset_gain`` squared (acceptance dropped, the batch got
longer contexts), an exploration starts early; the current arm is never dropped on stale numbers
alone.

The caller decides which steps are timed: a step that compiles or plans a new shape, grows a
cache buffer or resumes the head after plain steps is a one-off, not an arm's steady cost.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Arm:
    """Recent cost and yield of one draft count, per row-step: step times (a median: robust to
    load spikes) and tokens emitted (a mean: acceptance is a coin per step, a median of it is
    biased; the machine's speed does not move it, so a longer history is kept)."""

    seconds: deque = field(default_factory=lambda: deque(maxlen=9))
    tokens: deque = field(default_factory=lambda: deque(maxlen=16))
    last_used: int = -1

    @property
    def n(self) -> int:
        return len(self.seconds)

    def rate(self) -> float:
        """Tokens per second per row."""
        return statistics.fmean(self.tokens) / statistics.median(self.seconds) if self.seconds else 0.0


@dataclass
class _Bucket:
    arms: list[Arm]
    interval: int  # steps between explorations
    current: int = 0  # the chosen draft count
    decided: bool = False  # every arm was timed and a first choice made
    steps: int = 0
    next_explore: int = 0
    last_explored: int = 0
    exploring: int = -1  # the draft count being explored, -1 when none
    explore_left: int = 0  # timed steps the exploration still needs
    explore_rows: int = 0  # row-steps it still needs
    explore_began: int = 0
    reference: float = 0.0  # the current arm's rate just before the running exploration
    baseline: float = 0.0  # the current arm's rate when it was last confirmed


def bucket_of(batch: int) -> int:
    return 1 << (batch - 1).bit_length()  # 1, 2, 4, 8, ...: nearby sizes share measurements


class DraftSchedule:
    def __init__(
        self,
        k: int,
        *,
        explore_every: int = 16,
        max_explore_every: int = 256,
        explore_steps: int = 5,
        explore_rows: int = 8,
        margin: float = 1.03,
        reset_gain: float = 1.15,
    ) -> None:
        self.k = k
        self.explore_rows = explore_rows
        self.explore_every = explore_every
        self.max_explore_every = max(max_explore_every, explore_every)
        self.explore_steps = explore_steps
        self.margin = margin
        self.reset_gain = reset_gain
        self._buckets: dict[int, _Bucket] = {}
        self.switches = 0  # changes of choice after the first (for stats and tests)

    def _bucket(self, batch: int) -> _Bucket:
        b = bucket_of(batch)
        if b not in self._buckets:
            arms = [Arm() for _ in range(self.k + 1)]
            self._buckets[b] = _Bucket(arms, interval=self.explore_every)
        return self._buckets[b]

    def choose(self, batch: int) -> int:
        """The draft count for the next step of a batch of ``batch`` rows."""
        s = self._bucket(batch)
        s.steps += 1
        if not s.decided:
            # Each arm is timed once, most drafts first; once timed an arm always keeps samples.
            untried = [j for j in range(self.k, -1, -1) if s.arms[j].n == 0]
            if untried:
                return untried[0]
            # The arms were just timed one after another. Plain decoding unless drafting pays
            # by the margin.
            rate = [a.rate() for a in s.arms]
            best = max(range(self.k + 1), key=rate.__getitem__)
            s.current = best if rate[best] > self.margin * rate[0] else 0
            s.decided, s.baseline = True, rate[s.current]
            s.last_explored, s.next_explore = s.steps, s.steps + s.interval
        if s.exploring >= 0 and s.steps - s.explore_began > 4 * max(self.explore_steps, self.explore_rows):
            self._end_exploration(s)  # its draft count could not run (no row wanted to draft)
        if s.exploring >= 0:
            return s.exploring
        current = s.arms[s.current]
        # Over all its kept steps and by more than a clear change: a noisy machine's slow patches
        # must not trigger explorations (each costs a switch there and back).
        degraded = (current.rate() * self.reset_gain**2 < s.baseline
                    and s.steps - s.last_explored >= self.explore_every)
        if s.steps >= s.next_explore or degraded:
            # The current arm's kept steps are its latest (it runs every step): a median over all
            # of them, so that one noisy moment just before does not decide.
            s.reference = current.rate()
            s.exploring = min((j for j in range(self.k + 1) if j != s.current), key=lambda j: s.arms[j].last_used)
            s.explore_left, s.explore_rows, s.explore_began = self.explore_steps, self.explore_rows, s.steps
            return s.exploring
        return s.current

    def record(self, batch: int, drafts: int, tokens_per_row: float, seconds_per_row: float) -> None:
        """A timed step of ``batch`` rows that drafted ``drafts`` tokens."""
        s = self._bucket(batch)
        arm = s.arms[drafts]
        if s.exploring == drafts and s.explore_left == self.explore_steps:
            # Measured afresh: its step times are judged against the current arm's latest, and its
            # old yield may come from other requests (short ones, where rows stop drafting).
            arm.seconds.clear()
            arm.tokens.clear()
        arm.seconds.append(seconds_per_row)
        arm.tokens.append(tokens_per_row)
        arm.last_used = s.steps
        if s.exploring == drafts:
            s.explore_left -= 1
            s.explore_rows -= batch
            if s.explore_left <= 0 and s.explore_rows <= 0:  # enough steps, and rows for a yield
                self._end_exploration(s)

    def _end_exploration(self, s: _Bucket) -> None:
        j, s.exploring, before = s.exploring, -1, s.current
        challenger = s.arms[j].rate() if s.explore_left <= 0 and s.explore_rows <= 0 else 0.0
        switched = challenger > self.margin * s.reference
        if switched:
            self.switches += 1
            s.current = j
        s.baseline = challenger if switched else s.reference
        clear_change = switched and challenger > self.reset_gain * s.reference
        if clear_change:
            s.interval = self.explore_every
        elif switched and j < before:
            s.interval = max(self.explore_every, s.interval // 4)
        else:
            s.interval = min(2 * s.interval, self.max_explore_every)
        s.last_explored = s.steps
        s.next_explore = s.steps + s.interval

    def throughput_by_batch(self) -> dict[int, list[float | None]]:
        """Per bucket, tokens per second per row of each draft count (None: not timed yet)."""
        return {
            b: [round(a.rate(), 1) if a.n else None for a in s.arms] for b, s in sorted(self._buckets.items())
        }

    def choice_by_batch(self) -> dict[int, int]:
        return {b: s.current for b, s in sorted(self._buckets.items())}
