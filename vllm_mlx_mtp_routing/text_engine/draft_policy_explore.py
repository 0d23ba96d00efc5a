"""(Temporary, for the same-run A/B against the cost model) The draft policy: how many drafts a step verifies (``plan``) and what it learns from the step
(``observe``), apart from the math of drafting and verifying. Tested without a model.

``adaptive``: per step the draft count (0..k) is chosen by measured throughput per batch-size
bucket (``DraftSchedule``); a step drafts only while some row's recent acceptance (an EMA) is at
least ``min_row_acceptance`` (rows probe again every ``probe_every`` steps), and then every row
that can draft does (a row left out is fed padding that costs the verify what its draft would).
Only steady steps are timed: the step before had the same shape (batch, draft count, KV span) and
the head did not resume after plain steps. A seeded sampled row does not draft under adaptive
drafting (its drafting would depend on the batch and the clock, and so would its output).
``adaptive=False`` drafts k every step; ``max_batch_size`` turns drafting off above that batch.
"""

from __future__ import annotations

from typing import Any, Sequence

from .draft_schedule import DraftSchedule
from .mtp_rows import MTPRowState
from .sampling import RowSampler


class ExploringDraftPolicy:
    def __init__(
        self,
        k: int,
        *,
        adaptive: bool = True,
        max_batch_size: int | None = None,
        min_row_acceptance: float = 0.15,
        probe_every: int = 16,
        explore_every: int = 16,
        max_explore_every: int = 256,
        explore_steps: int = 5,
        margin: float = 1.03,
        reset_gain: float = 1.15,
    ) -> None:
        self.k = k
        self.adaptive = adaptive
        self.max_batch_size = max_batch_size
        self.min_row_acceptance = min_row_acceptance
        self.probe_every = probe_every
        self.schedule = DraftSchedule(
            k, explore_every=explore_every, max_explore_every=max_explore_every,
            explore_steps=explore_steps, margin=margin, reset_gain=reset_gain,
        )
        self._last_shape: tuple[int, ...] = ()

    def draft_count(self, batch: int) -> int:
        """Drafts for a step of this batch size, before looking at the rows."""
        if self.max_batch_size is not None and batch > self.max_batch_size:
            return 0
        return self.schedule.choose(batch) if self.adaptive else self.k

    def can_draft(self, row: MTPRowState, sampler: RowSampler) -> bool:
        if self.adaptive and sampler.options.seed is not None and not sampler.greedy:
            return False
        if not row.pending_t:  # a one-token prompt's first step: the head has no pair yet
            return False
        return len(row.history) - row.prompt_len + 1 < sampler.options.max_tokens  # not its last token

    def worth_drafting(self, row: MTPRowState) -> bool:
        """Whether this row alone makes a drafting step worth its head and its wider verify."""
        return not self.adaptive or row.ema >= self.min_row_acceptance or row.idle >= self.probe_every

    def plan(self, k: int, rows: Sequence[MTPRowState], samplers: Sequence[RowSampler]) -> tuple[int, list[bool]]:
        """(drafts this step, which rows draft) given the step's draft count ``k``."""
        drafting = [k > 0 and self.can_draft(r, s) for r, s in zip(rows, samplers)]
        if not any(d and self.worth_drafting(r) for d, r in zip(drafting, rows)):
            return 0, [False] * len(rows)
        return k, drafting

    def observe(
        self, rows: Sequence[MTPRowState], k: int, drafting: list[bool], accepted: list[int], *,
        tokens: int, seconds: float | None, shape: tuple[int, ...], timed: bool = True,
    ) -> None:
        """A step ran: rows' acceptance, and its cost per row-step when it was a steady one."""
        for r, d, a in zip(rows, drafting, accepted):
            r.observe(d, a, k)
        B = len(rows)
        if not self.adaptive or (self.max_batch_size is not None and B > self.max_batch_size):
            return
        # The first step of a shape compiles, traces or plans (CUDA), and the first after a
        # switch pays for the switch: what a switch costs, not what a draft count costs per step.
        steady, self._last_shape = shape == self._last_shape, shape
        if steady and timed and seconds is not None:
            self.schedule.record(B, k, tokens / B, seconds / B)

    def stats(self) -> dict[str, Any]:
        return {
            "adaptive": self.adaptive,
            "throughput_by_batch": self.schedule.throughput_by_batch(),
            "draft_count_by_batch": self.schedule.choice_by_batch(),
        }
