"""Batched MTP speculative decoding with per-row acceptance: what the scheduler plans with and the runner runs.

One step for a batch of B rows, each row i holding its prompt and generated tokens up to the token x_i it feeds
next (the runner executes it, see runner.py):

1. draft (``proposer.py``): the MTP head takes each row's pairs verified since its last draft and proposes k tokens
   per row (argmax for greedy rows, sampled from the row's processed distribution q for the others);
2. verify (``verify.py``): ONE backbone forward of [x_i, d_i1..d_ik] for the whole batch;
3. accept (``acceptance.py``), per row: greedy rows take the longest prefix of drafts equal to the backbone's
   argmax; sampled rows run speculative sampling (accept d with prob min(1, p(d)/q(d)), else resample from
   norm(max(p - q, 0)); the bonus token from p after the last accepted draft). Row i emits 1 + a_i tokens;
4. roll back (``verify.py``), per row, what it rejected.

Rows that do not draft this step (no pairs yet, at most one token left) feed padding. When no row drafts, the step
is a plain [B, 1] decode and the head does not run. Whether a step drafts, and which rows, is the draft policy's
call (``draft_policy.py``), made by the scheduler when it plans the step.

Seeds: every random number comes from the row's own ``RowSampler`` key stream, a fixed number of keys per step for a
given draft count, so a seeded request reproduces given the same drafting decisions; the draft policy makes a seeded
sampled row's decisions depend on the row alone. A row that never drafts consumes keys as plain decoding does.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ...model.mtp import MTPHead
from ..batch_cache import BatchCache, RaggedKVCache
from ..decode_batch import DecodeBatch
from ..row import Row
from ..sampling import RowSampler
from ..step_plan import DecodePlan, DecodeResult
from .acceptance import accept_rows
from .draft_policy import DraftPolicy
from .mtp_rows import MTPRowState
from .proposer import DEFAULT_PROMPT_PAIRS, MTPProposer

# (verify logits [B, k+1, V], drafts [B, k] or None, q per sampled drafting row, drafting, samplers, k)
#   -> (tokens per row, accepted drafts per row)
Acceptance = Callable[
    [mx.array, "mx.array | None", dict[int, mx.array], list[bool], list[RowSampler], int],
    tuple[list[list[int]], list[int]],
]

__all__ = ["DEFAULT_PROMPT_PAIRS", "Acceptance", "MTPDecode"]


class MTPDecode:
    """The text engine's speculative decoding: a proposer, the acceptance rule, the draft policy and the counts.

    ``BatchScheduler(model, tokenizer, decode=MTPDecode(bundle.mtp, k=1))``; the head must be bound to the same
    TextModel (``build_text_model`` does that). ``policy`` replaces the ``DraftPolicy(k, adaptive=...,
    max_batch_size=...)`` built from the other arguments; ``proposer`` and ``acceptance`` replace the head's own
    proposer and ``accept_rows`` (benchmarks and tests control drafts or acceptance with them). ``choose_count``: the
    adaptive policy may draft fewer than k where that pays more (draft_policy.py).
    """

    def __init__(
        self,
        head: MTPHead,
        k: int = 1,
        *,
        hidden_state_mode: str | None = None,
        adaptive: bool = True,
        choose_count: bool = False,
        max_batch_size: int | None = None,
        per_row_acceptance: bool = True,
        resume_window: int = 8,
        prompt_pairs: int | None = DEFAULT_PROMPT_PAIRS,
        policy: DraftPolicy | None = None,
        proposer: MTPProposer | None = None,
        acceptance: Acceptance | None = None,
    ) -> None:
        self.proposer = proposer or MTPProposer(
            head, k, hidden_state_mode=hidden_state_mode, resume_window=resume_window, prompt_pairs=prompt_pairs
        )
        self.head = head
        self.k = k
        self.hidden_state_mode = self.proposer.hidden_state_mode
        self.per_row_acceptance = per_row_acceptance  # False: batch-wide all-or-nothing, for comparison
        self.accept: Acceptance = acceptance or functools.partial(accept_rows, per_row=per_row_acceptance)
        self.policy = policy or DraftPolicy(k, adaptive=adaptive, max_batch_size=max_batch_size,
                                            choose_count=choose_count)
        self._fresh_state()

    def _fresh_state(self) -> None:
        """What stepping a batch accumulates: step timing and counts (``twin`` starts from none)."""
        self._version = -1
        # End of the last step, None after a join or leave. A step is timed from there (when the batch did not
        # change in between): the whole cycle, with the scheduler's and the server's own per-step work.
        self._last_end: float | None = None
        self.drafted = 0
        self.accepted = 0
        self.media_drafted = 0  # of those, by rows of media requests (images)
        self.media_accepted = 0
        self.steps_with_mtp = 0
        self.steps_without_mtp = 0
        self.accepted_histogram = [0] * (self.k + 1)  # per drafting row-step: how many drafts it kept

    def twin(self, policy: DraftPolicy) -> MTPDecode:
        """The head's own proposer and this acceptance with none of this one's timings or counts, drafting as
        ``policy`` decides: the start-up warm-up steps it (warmup.py), so nothing it does reaches this one's policy
        or stats."""
        twin = copy.copy(self)
        twin.policy = policy
        twin.proposer = self.proposer.plain()
        twin._fresh_state()
        return twin

    @property
    def adaptive(self) -> bool:
        return self.policy.adaptive

    @property
    def head_layers(self) -> int:
        return self.proposer.head_layers

    @property
    def prompt_pairs(self) -> int | None:
        return self.proposer.prompt_pairs

    # -- planning ------------------------------------------------------------------------------

    def plan(self, batch: DecodeBatch) -> tuple[int, list[bool]]:
        """This step's draft count and the rows that draft (the draft policy's decision)."""
        rows = _states(batch)
        return self.policy.plan(self.policy.draft_count(len(rows)), rows, [r.sampler for r in batch.rows])

    def can_draft(self, row: Row) -> bool:
        """Whether ``row`` can draft this step (it has a verified pair and is not at its last token)."""
        return row.spec is not None and self.policy.can_draft(row.spec, row.sampler)

    # -- after the step ------------------------------------------------------------------------

    def observe(self, batch: DecodeBatch, plan: DecodePlan, result: DecodeResult) -> None:
        """Count a finished step and tell the policy what it cost (not timed when rows joined or left since the
        last one: the batch's ``version`` changed)."""
        k, drafting, accepted, rows = plan.draft_tokens, plan.drafting, result.accepted, _states(batch)
        if batch.version != self._version:
            self._version, self._last_end = batch.version, None
        end = time.perf_counter()
        seconds = None if self._last_end is None else end - self._last_end
        self._last_end = end
        if k:
            self.steps_with_mtp += 1
        else:
            self.steps_without_mtp += 1
        for row, d, a in zip(batch.rows, drafting, accepted):
            if d:
                self.drafted += k
                self.accepted += a
                self.accepted_histogram[a] += 1
                if row.req.media is not None:
                    self.media_drafted += k
                    self.media_accepted += a
        self.policy.observe(rows, k, drafting, accepted, seconds=seconds,
                            shape=self._shape(batch.backbone, batch.head, len(rows), k), timed=not result.caught_up)

    @staticmethod
    def _shape(cache: BatchCache, head: list[RaggedKVCache], B: int, k: int) -> tuple[int, ...]:
        """What a step's kernels are specialized on: the batch, the draft count and the spans of keys attention
        reads (on CUDA a new span is a new attention plan)."""
        kv = next((c for c in cache.layers if isinstance(c, RaggedKVCache)), None)
        caps = [c.capacity if c is not None else 0 for c in (kv, head[0])]
        return (B, k, *caps)

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "k": self.k,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "media_rows": {"drafted": self.media_drafted, "accepted": self.media_accepted,
                           "acceptance_rate": self.media_accepted / self.media_drafted if self.media_drafted else 0.0},
            "steps_with_mtp": self.steps_with_mtp,
            "steps_without_mtp": self.steps_without_mtp,
            "accepted_histogram": list(self.accepted_histogram),
            "per_row_acceptance": self.per_row_acceptance,
            **self.policy.stats(),
        }


def _states(batch: DecodeBatch) -> list[MTPRowState]:
    """The rows' MTP states, in batch row order (each joined row has one under MTP)."""
    states = [r.spec for r in batch.rows]
    if any(s is None for s in states):
        raise RuntimeError("a row joined the batch without its MTP state")
    return [s for s in states if s is not None]
