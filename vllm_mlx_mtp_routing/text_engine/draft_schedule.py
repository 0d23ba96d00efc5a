"""How many tokens to draft this step (0..k), chosen from measured throughput per batch size.

Each batch-size bucket (1, 2, 3-4, 5-8, ...) keeps one ``Arm`` per draft count: the median
seconds and mean tokens per row-step of its recent timed steps. The choice is the arm with the
best tokens per second, with hysteresis: another arm must beat the current one by ``margin`` to
take over, so near break-even the schedule does not flip on timing noise (each flip back to
drafting costs the MTP head a catch-up that is never timed). The current arm's numbers are always
fresh; the others' go stale, so every ``interval`` steps the stalest other arm runs for
``explore_steps`` timed steps. The interval doubles, up to ``max_explore_every``, unless an
exploration finds a clearly better arm (``reset_gain``): near a tie a wrong choice costs little
and exploring costs a catch-up each time, so exploring backs off there too.

The caller decides which steps are timed: a step that compiles or plans a new shape, grows a
cache buffer or resumes the head after plain steps is a one-off, not an arm's steady cost.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Arm:
    """Recent cost and yield of one draft count, per row-step: the median step time (robust to
    load spikes) and the mean tokens emitted (acceptance is a coin per step; a median of it is
    biased)."""

    seconds: deque = field(default_factory=lambda: deque(maxlen=9))
    tokens: deque = field(default_factory=lambda: deque(maxlen=16))
    last_used: int = -1

    @property
    def n(self) -> int:
        return len(self.seconds)

    @property
    def rate(self) -> float:
        return statistics.fmean(self.tokens) / statistics.median(self.seconds) if self.seconds else 0.0


@dataclass
class _Bucket:
    arms: list[Arm]
    interval: int  # steps between explorations
    current: int = 0  # the chosen draft count
    steps: int = 0
    next_explore: int = 0
    exploring: int = -1  # the draft count being explored, -1 when none
    explore_left: int = 0  # timed steps the exploration still needs
    explore_began: int = 0
    before: int = 0  # the choice when the running exploration began
    decided: bool = False  # a choice was made with every arm timed


def bucket_of(batch: int) -> int:
    return 1 << (batch - 1).bit_length()  # 1, 2, 4, 8, ...: nearby sizes share measurements


class DraftSchedule:
    def __init__(
        self,
        k: int,
        *,
        explore_every: int = 16,
        max_explore_every: int = 256,
        explore_steps: int = 3,
        margin: float = 1.03,
        reset_gain: float = 1.15,
    ) -> None:
        self.k = k
        self.explore_every = explore_every
        self.max_explore_every = max(max_explore_every, explore_every)
        self.explore_steps = explore_steps
        self.margin = margin
        self.reset_gain = reset_gain
        self._buckets: dict[int, _Bucket] = {}
        self.switches = 0  # changes of choice after every arm was timed (for stats and tests)

    def _bucket(self, batch: int) -> _Bucket:
        b = bucket_of(batch)
        if b not in self._buckets:
            arms = [Arm() for _ in range(self.k + 1)]
            self._buckets[b] = _Bucket(arms, interval=self.explore_every, next_explore=self.explore_every)
        return self._buckets[b]

    def choose(self, batch: int) -> int:
        """The draft count for the next step of a batch of ``batch`` rows."""
        s = self._bucket(batch)
        s.steps += 1
        untried = [j for j in range(self.k, -1, -1) if s.arms[j].n == 0]
        if untried:
            return untried[0]
        if s.exploring >= 0 and s.steps - s.explore_began > 4 * self.explore_steps:
            self._end_exploration(s)  # its draft count could not run (no row wanted to draft)
        if s.exploring >= 0:
            return s.exploring
        current = self._decide(s)
        if s.steps >= s.next_explore:
            s.before = current
            s.exploring = min((j for j in range(self.k + 1) if j != current), key=lambda j: s.arms[j].last_used)
            s.explore_left, s.explore_began = self.explore_steps, s.steps
            return s.exploring
        return current

    def record(self, batch: int, drafts: int, tokens_per_row: float, seconds_per_row: float) -> None:
        """A timed step of ``batch`` rows that drafted ``drafts`` tokens."""
        s = self._bucket(batch)
        arm = s.arms[drafts]
        if s.exploring == drafts and s.explore_left == self.explore_steps:
            # Its old samples describe another time (context length, acceptance, batch mix);
            # mixed in, they would outvote what the exploration measures now.
            arm.seconds.clear()
            arm.tokens.clear()
        arm.seconds.append(seconds_per_row)
        arm.tokens.append(tokens_per_row)
        arm.last_used = s.steps
        if s.exploring == drafts:
            s.explore_left -= 1
            if s.explore_left <= 0:
                self._end_exploration(s)

    def _decide(self, s: _Bucket) -> int:
        rate = [a.rate for a in s.arms]
        best = max(range(self.k + 1), key=rate.__getitem__)
        # The first choice starts from plain: drafting must show that it pays by the margin.
        if rate[best] > self.margin * rate[s.current]:
            self.switches += s.decided and best != s.current
            s.current = best
        s.decided = True
        return s.current

    def _end_exploration(self, s: _Bucket) -> None:
        s.exploring = -1
        rate = [a.rate for a in s.arms]
        after = self._decide(s)
        clear_change = after != s.before and rate[after] > self.reset_gain * rate[s.before]
        s.interval = self.explore_every if clear_change else min(2 * s.interval, self.max_explore_every)
        s.next_explore = s.steps + s.interval

    def throughput_by_batch(self) -> dict[int, list[float | None]]:
        """Per bucket, tokens per second per row of each draft count (None: not timed yet)."""
        return {
            b: [round(a.rate, 1) if a.n else None for a in s.arms] for b, s in sorted(self._buckets.items())
        }

    def choice_by_batch(self) -> dict[int, int]:
        return {b: s.current for b, s in sorted(self._buckets.items())}
