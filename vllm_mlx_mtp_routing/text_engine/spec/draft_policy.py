"""The draft policy: whether a step verifies k drafts (``plan``) and what it learns from the step
(``observe``), apart from the math of drafting and verifying. Tested without a model.

``adaptive``: a cost model. Per batch-size bucket a drafting step costs r plain steps (``DraftCosts``:
measured from blocks of the engine's own steady steps alternating between drafting and not, when a
bucket is first met and again now and then while the choice is within r's error of a tie), and row i yields
1 + a_i tokens when it drafts, a_i its recent accepted drafts per drafting step. A step drafts when
the rows' tokens pay for it: sum_i (1 + a_i) > r * B, the issue's (1 + a) t1 > t2 + tm with the
engine's step as it runs (the scheduler's and the server's per-step work included). Then every row
that can draft does: a row left out would be fed padding that costs the verify what its draft
would. While acceptance keeps a bucket plain but drafting could pay at a higher one (r < 1 + k), one
step in ``probe_every`` drafts, so the rows' acceptance does not go stale; a bucket where
r >= 1 + k never drafts once measured. A cost model rather than exploring draft counts by their
throughput: it decides from what a step costs and what the rows accept, with next to no tunables.

A seeded sampled row drafts k whenever it can (it has a verified pair and is not at its last
token), whatever the batch or the clock decide for the others: its drafts and random keys then
depend on the row alone, and so does its output, alone or in any batch. A step with such a row
drafts for every row that can.
``adaptive=False`` drafts k every step; ``max_batch_size`` turns drafting off above that batch (for
seeded rows too: their output then depends on whether the batch crossed it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..sampling import RowSampler
from .draft_costs import DraftCosts, bucket_of
from .mtp_rows import MTPRowState

ROW_RATE = 1 / 8  # a row's acceptance: an EMA over its drafting steps (a coin per step at k = 1)
PRIOR_RATE = 1 / 32  # a new row's starting estimate: the recent acceptance of every row
HOLD = 0.03  # drafting stops when it loses by this much (see _pays)


class DraftPolicy:
    def __init__(
        self, k: int, *, adaptive: bool = True, max_batch_size: int | None = None, probe_every: int = 32,
        refine_every: int = 256, costs: DraftCosts | None = None,
    ) -> None:
        self.k = k
        self.adaptive = adaptive
        self.max_batch_size = max_batch_size
        self.probe_every = probe_every
        self.refine_every = refine_every
        self._since_refine: dict[int, int] = {}  # per bucket: steps since its cost ratio was refined
        self.costs = costs or DraftCosts()
        self.prior: float | None = None  # accepted drafts per drafting row-step, over all rows
        self._plain_run: dict[int, int] = {}  # per bucket: plain steps since it last drafted
        self._choice: dict[int, int] = {}
        self._last_shape: tuple[int, ...] = ()

    def draft_count(self, batch: int) -> int:
        """Drafts for a step of this batch size, before looking at the rows."""
        if self.max_batch_size is not None and batch > self.max_batch_size:
            return 0
        return self.k

    @staticmethod
    def can_draft(row: MTPRowState, sampler: RowSampler) -> bool:
        if not row.pending_t:  # a one-token prompt's first step: the head has no pair yet
            return False
        return len(row.history) - row.prompt_len + 1 < sampler.options.max_tokens  # not its last token

    def acceptance(self, row: MTPRowState) -> float:
        if row.acceptance is not None:
            return row.acceptance
        return self.k if self.prior is None else self.prior

    def plan(self, k: int, rows: Sequence[MTPRowState], samplers: Sequence[RowSampler]) -> tuple[int, list[bool]]:
        """(drafts this step, which rows draft) given the step's draft count ``k``."""
        drafting = [k > 0 and self.can_draft(r, s) for r, s in zip(rows, samplers)]
        if not any(drafting):
            return 0, drafting
        seeded = any(d and s.options.seed is not None and not s.greedy for d, s in zip(drafting, samplers))
        if not self.adaptive or seeded or self._pays(k, rows, drafting):
            return k, drafting
        return 0, [False] * len(rows)

    def _pays(self, k: int, rows: Sequence[MTPRowState], drafting: list[bool]) -> bool:
        B = len(rows)
        b = bucket_of(B)
        arm = self.costs.learning_arm(B)
        if arm is not None:
            go = arm
        else:
            r = self.costs.ratio(B)
            assert r is not None  # learning_arm runs a session until the bucket has a ratio
            tokens = sum(1 + self.acceptance(row) for row, d in zip(rows, drafting) if d) + drafting.count(False)
            # Drafting stops only when it clearly loses: a few unlucky rejections must not turn it
            # off, since a plain step measures no acceptance and only a probe could turn it back on.
            go = tokens > r * B * (1 - HOLD if self._choice.get(b) else 1)
            if not go and r < 1 + k:
                go = self._plain_run.get(b, 0) + 1 >= self.probe_every  # a probe: acceptance must not go stale
            self._since_refine[b] = self._since_refine.get(b, 0) + 1
            if abs(tokens / (r * B) - 1) < 2 * self.costs.uncertainty(B) and self._since_refine[b] >= self.refine_every:
                # r's error could flip this choice: measure it again, adding to what it has.
                self.costs.refine(B)
                self._since_refine[b] = 0
        self._plain_run[b] = 0 if go else self._plain_run.get(b, 0) + 1
        self._choice[b] = k if go else 0
        return go

    def observe(
        self, rows: Sequence[MTPRowState], k: int, drafting: list[bool], accepted: list[int], *,
        seconds: float | None, shape: tuple[int, ...], timed: bool = True,
    ) -> None:
        """A step ran: the rows' acceptance, and its cost when it was a steady one."""
        for r, d, a in zip(rows, drafting, accepted):
            if d:
                r.acceptance = self.acceptance(r) * (1 - ROW_RATE) + a * ROW_RATE
                self.prior = a if self.prior is None else self.prior + PRIOR_RATE * (a - self.prior)
        if not k and self.prior is not None:
            # Plain steps measure nothing: a row's estimate, left where an unlucky run of rejections
            # put it, would keep its batch plain. It relaxes to every row's (smoother) estimate.
            for r in rows:
                if r.acceptance is not None:
                    r.acceptance += ROW_RATE * (self.prior - r.acceptance)
        B = len(rows)
        if not self.adaptive or (self.max_batch_size is not None and B > self.max_batch_size):
            return
        # The first step of a shape compiles, traces or plans (CUDA), and the first after a
        # switch pays for the switch: what a switch costs, not what a step of either kind costs.
        steady, self._last_shape = shape == self._last_shape, shape
        if steady and timed and seconds is not None:
            self.costs.record(B, k > 0, seconds)

    def stats(self) -> dict[str, Any]:
        return {
            "adaptive": self.adaptive,
            "draft_cost_by_batch": self.costs.ratio_by_batch(),
            "draft_count_by_batch": dict(sorted(self._choice.items())),
            "acceptance_estimate": None if self.prior is None else round(self.prior, 3),
        }
