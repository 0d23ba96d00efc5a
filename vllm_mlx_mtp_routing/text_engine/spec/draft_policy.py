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

``choose_count`` (the server's, where k > 1): a drafting step may also verify fewer drafts than k. Each count
j = k, ..., 1 has its own cost ratio r_j, measured as above (the largest first), and row i yields 1 + E_j(i) tokens,
E_j(i) = p_i1 + p_i1 p_i2 + ... (p_ij: its recent acceptance of draft j when every draft before it was accepted).
The step takes the count whose tokens per unit of time is highest, plain included. Where the step is bound by
launching kernels (a GPU, the MoE models above all) a second draft costs the verify little more than a first;
where it is bound by arithmetic (a CPU) it does not pay.

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
from .mtp_rows import MTPRowState, expected_accepted

ROW_RATE = 1 / 8  # a row's acceptance: an EMA over its drafting steps (a coin per step at k = 1)
PRIOR_RATE = 1 / 32  # a new row's starting estimate: the recent acceptance of every row
HOLD = 0.03  # drafting (a count) stops when it loses by this much (see _best)


class DraftPolicy:
    def __init__(
        self, k: int, *, adaptive: bool = True, max_batch_size: int | None = None, probe_every: int = 32,
        refine_every: int = 256, costs: DraftCosts | None = None, choose_count: bool = False,
    ) -> None:
        self.k = k
        self.adaptive = adaptive
        self.max_batch_size = max_batch_size
        self.probe_every = probe_every
        self.refine_every = refine_every
        self._since_refine: dict[int, int] = {}  # per bucket: steps since its cost ratio was refined
        self.costs = costs or DraftCosts()  # drafting k
        # The draft counts a drafting step weighs, the largest first (the order their costs are measured in).
        self.counts = list(range(k, 0, -1)) if choose_count and adaptive else [k]
        self.costs_by_count = {j: self.costs if j == k else DraftCosts(block=self.costs.block, pairs=self.costs.pairs,
                                                                         keep=self.costs.keep) for j in self.counts}
        self.prior: list[float] | None = None  # per draft position, over all rows (see MTPRowState)
        self._prior_seen: list[bool] = [False] * k
        self._learning: dict[int, int] = {}  # per bucket: the count a cost session is measuring
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

    def position_acceptance(self, row: MTPRowState) -> list[float]:
        """The row's per-position acceptance; before it drafted, every row's (nothing measured: optimistic, 1)."""
        if row.position_acceptance is not None:
            return row.position_acceptance
        return list(self.prior) if self.prior is not None else [1.0] * self.k

    def acceptance(self, row: MTPRowState) -> float:
        """The row's accepted drafts per step drafting k."""
        return expected_accepted(self.position_acceptance(row), self.k)

    def plan(self, k: int, rows: Sequence[MTPRowState], samplers: Sequence[RowSampler]) -> tuple[int, list[bool]]:
        """(drafts this step, which rows draft) given the step's draft count ``k``."""
        drafting = [k > 0 and self.can_draft(r, s) for r, s in zip(rows, samplers)]
        if not any(drafting):
            return 0, drafting
        seeded = any(d and s.options.seed is not None and not s.greedy for d, s in zip(drafting, samplers))
        if not self.adaptive or seeded:
            return k, drafting
        count = self._choose(k, rows, drafting)
        return (count, drafting) if count else (0, [False] * len(rows))

    def _choose(self, k: int, rows: Sequence[MTPRowState], drafting: list[bool]) -> int:
        """This step's draft count, at most ``k`` (0: plain)."""
        B = len(rows)
        b = bucket_of(B)
        counts = [j for j in self.counts if j <= k]
        choice = None
        for j in counts:
            arm = self.costs_by_count[j].learning_arm(B)
            if arm is not None:  # a session measures j's cost: its blocks decide
                self._learning[b] = j
                choice = j if arm else 0
                break
        if choice is None:
            self._learning.pop(b, None)
            choice = self._best(B, counts, rows, drafting)
        self._plain_run[b] = 0 if choice else self._plain_run.get(b, 0) + 1
        self._choice[b] = choice
        return choice

    def _best(self, B: int, counts: list[int], rows: Sequence[MTPRowState], drafting: list[bool]) -> int:
        """The count with the most tokens per unit of time, each count's cost measured."""
        b = bucket_of(B)
        ratios: dict[int, float] = {}
        for j in counts:
            r = self.costs_by_count[j].ratio(B)
            assert r is not None  # learning_arm runs a session until the count has a ratio
            ratios[j] = r
        accept = [self.position_acceptance(row) for row, d in zip(rows, drafting) if d]
        idle = drafting.count(False)
        values = {0: 1.0}  # tokens per plain step's time, per row
        for j, r in ratios.items():
            values[j] = (sum(1 + expected_accepted(p, j) for p in accept) + idle) / (r * B)
        # Drafting stops only when it clearly loses: a few unlucky rejections must not turn it off, since a plain
        # step measures no acceptance and only a probe could turn it back on.
        held = self._choice.get(b, 0)
        score = {j: v / (1 - HOLD) if j and j == held else v for j, v in values.items()}
        best = max(score, key=lambda j: (score[j], -j))  # a tie: fewer drafts
        if not best:  # a probe, where drafting could pay: acceptance must not go stale
            could = [j for j, r in ratios.items() if r < 1 + j]
            if could and self._plain_run.get(b, 0) + 1 >= self.probe_every:
                best = max(could, key=lambda j: (1 + j) / ratios[j])
        self._since_refine[b] = self._since_refine.get(b, 0) + 1
        top = sorted(values, key=lambda j: values[j], reverse=True)[:2]
        spread = max(self.costs_by_count[j].uncertainty(B) for j in top if j) if any(top) else 0.0
        if abs(values[top[0]] - values[top[1]]) < 2 * spread and self._since_refine[b] >= self.refine_every:
            # The ratios' error could flip this choice: measure them again, adding to what they have.
            for j in top:
                if j:
                    self.costs_by_count[j].refine(B)
            self._since_refine[b] = 0
        return best

    def observe(
        self, rows: Sequence[MTPRowState], k: int, drafting: list[bool], accepted: list[int], *,
        seconds: float | None, shape: tuple[int, ...], timed: bool = True,
    ) -> None:
        """A step ran: the rows' acceptance, and its cost when it was a steady one."""
        for r, d, a in zip(rows, drafting, accepted):
            if d:
                self._learn(r, k, a)
        if not k and self.prior is not None:
            # Plain steps measure nothing: a row's estimate, left where an unlucky run of rejections
            # put it, would keep its batch plain. It relaxes to every row's (smoother) estimate.
            for r in rows:
                if r.position_acceptance is not None:
                    r.position_acceptance = [p + ROW_RATE * (q - p) for p, q in zip(r.position_acceptance, self.prior)]
        B = len(rows)
        if not self.adaptive or (self.max_batch_size is not None and B > self.max_batch_size):
            return
        # The first step of a shape compiles, traces or plans (CUDA), and the first after a
        # switch pays for the switch: what a switch costs, not what a step of either kind costs.
        steady, self._last_shape = shape == self._last_shape, shape
        if steady and timed and seconds is not None:
            # A plain step is the other arm of the session under way (drafting k when none runs: it ignores it).
            owner = self.costs_by_count.get(k if k else self._learning.get(bucket_of(B), self.k))
            if owner is not None:
                owner.record(B, k > 0, seconds)

    def _learn(self, row: MTPRowState, k: int, accepted: int) -> None:
        """A drafting step of ``row``: draft j was judged when every draft before it was accepted."""
        p = self.position_acceptance(row)
        if self.prior is None:
            self.prior = [1.0] * self.k
        for j in range(min(accepted + 1, k, self.k)):
            hit = float(j < accepted)
            p[j] = p[j] * (1 - ROW_RATE) + hit * ROW_RATE
            # every row's estimate starts at the first outcome seen
            self.prior[j] = self.prior[j] + PRIOR_RATE * (hit - self.prior[j]) if self._prior_seen[j] else hit
            self._prior_seen[j] = True
        row.position_acceptance = p

    def stats(self) -> dict[str, Any]:
        return {
            "adaptive": self.adaptive,
            "draft_cost_by_batch": self.costs.ratio_by_batch(),
            "draft_cost_by_count": {j: c.ratio_by_batch() for j, c in sorted(self.costs_by_count.items())},
            "draft_count_by_batch": dict(sorted(self._choice.items())),
            "acceptance_estimate": None if self.prior is None else round(expected_accepted(self.prior, self.k), 3),
            "position_acceptance_estimate": None if self.prior is None else [round(p, 3) for p in self.prior],
        }
