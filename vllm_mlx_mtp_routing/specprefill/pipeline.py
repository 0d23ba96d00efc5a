"""SpecPrefill inside the text engine: per request, score with the draft, then prefill sparsely,
in pieces the scheduler runs between decode steps of its batch (``BatchScheduler._prefill``).

``SpecPrefill.start`` decides when a request's prefill begins (after its prefix-cache lookup, so
only the part not restored is scored and a hit's prefix stays dense; a system prompt the cache is to
snapshot is prefilled densely first, so later requests hit it); ``SparseJob.advance`` runs
one piece: a draft prefill chunk, the look-ahead and selection, or a chunk of kept tokens on the
target. A scoring error (the draft's side) leaves the request's own caches untouched: it logs one
line and the request is prefilled densely from where it was. A sparse row's state is never stored
in the prefix cache (its snapshot plan is emptied, and its batch row is not a dense prefix).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..prefix_cache.plan import SnapshotPlan
from ..text_engine.row import Row
from ..text_engine.spec.mtp import MTPDecode
from ..text_engine.state import PrefillState
from .metrics import SpecPrefillMetrics
from .scoring import ScoringJob, draft_chunk
from .settings import RequestChoice, SpecPrefillSettings, decide
from .sparse_prefill import SparsePrefill

logger = logging.getLogger("vllm_mlx_mtp_routing.specprefill")


class SparseTarget(Protocol):
    """The engine that prefills the kept tokens (``text_engine.scheduler.BatchScheduler``): its model, its prefill
    chunk and its MTP decode, whose head's caches a sparse prefill fills too."""

    model: nn.Module
    prefill_chunk: int
    spec: MTPDecode | None


class SpecPrefill:
    """The text engine's SpecPrefill: the draft model, the server's settings, the counters."""

    def __init__(self, draft: nn.Module, settings: SpecPrefillSettings | None = None) -> None:
        self.draft = draft
        self.settings = settings or SpecPrefillSettings()
        self.metrics = SpecPrefillMetrics()
        self._params: dict[int, int] = {}  # id(model) -> its parameter count, for the draft's chunk

    def draft_chunk(self, scheduler: SparseTarget) -> int:
        """The draft's prompt chunk beside ``scheduler``'s (``scoring.draft_chunk``): fixed for the server's life, so a
        prompt's scores never depend on the other requests."""
        sizes = [self._params.setdefault(id(m), _parameters(m)) for m in (scheduler.model, self.draft)]
        return draft_chunk(scheduler.prefill_chunk, *sizes)

    def start(self, seq: Row, scheduler: SparseTarget) -> SparseJob | None:
        """The request's sparse job, or None (dense) with the reason counted."""
        choice: RequestChoice = seq.req.specprefill or RequestChoice()
        start = dense_prefix(seq)
        suffix = seq.to_prefill - start
        seq.specprefill_outcome = outcome(choice.enabled, "engaged", suffix)
        if choice.enabled is False:
            self._dense(seq, "opted_out")
            return None
        fractions = decide(self.settings, choice, suffix)
        if fractions is None:
            self._dense(seq, "below_threshold" if suffix <= self.settings.threshold or suffix < 2 else "keep_all")
            return None
        if seq.to_prefill > self.settings.max_tokens:
            logger.info("SpecPrefill: %s has %d prompt tokens, more than the draft scores (%d): dense prefill",
                        seq.rid, seq.to_prefill + 1, self.settings.max_tokens)
            self._dense(seq, "too_long")
            return None
        job = SparseJob(self, seq, scheduler, start, *fractions)
        return job if job.active else None

    def _dense(self, seq: Row, reason: str) -> None:
        self.metrics.skipped(reason)
        assert seq.specprefill_outcome is not None  # set by start
        seq.specprefill_outcome["reason"] = OUTCOME_REASONS[reason]


# The host's words for its per-response SpecPrefill diagnostics (vllm-mlx 0.6.0 mllm_batch_generator).
OUTCOME_REASONS = {"opted_out": "disabled_by_request", "below_threshold": "below_threshold", "keep_all": "selection_not_sparse",
                   "too_long": "prompt_too_long", "scoring_failed": "scoring_failed", "no_draft": "draft_unavailable"}


def outcome(requested: bool | None, reason: str, original_tokens: int = 0, selected_tokens: int = 0) -> dict:
    """A request's SpecPrefill diagnostics (the host's ``SpecPrefillOutcome`` fields on the text path):
    ``original_tokens`` the prompt tokens it could drop (after any dense prefix), ``selected_tokens`` those kept."""
    return {"requested": requested, "engaged": False, "reason": reason, "route": "text",
            "original_tokens": original_tokens, "selected_tokens": selected_tokens}


def dense_prefix(seq: Row) -> int:
    """Where the sparse part of a prompt starts: after a prefix-cache hit, and after the system
    prompt when the cache is to snapshot it (as the host's system-KV cache does, so the next request
    with that system prompt hits it; a snapshot is never taken of a sparse state)."""
    system = [p for p in (seq.plan.snapshots_of("system") if seq.plan is not None else ()) if p < seq.to_prefill]
    return max([seq.prefilled, *system])


class SparseJob:
    """One request's scoring then sparse prefill (see the module docstring)."""

    def __init__(self, owner: SpecPrefill, seq: Row, scheduler: SparseTarget, start: int, keep_pct: float, backbone_pct: float) -> None:
        self.owner = owner
        self.seq = seq
        self.scheduler = scheduler
        self.start = start
        self.scoring: ScoringJob | None = None
        self.prefill: SparsePrefill | None = None
        self.scoring_s = 0.0
        self.prefill_s = 0.0
        self._draft_scale = 1  # draft tokens a target token's cost buys (its chunk over the target's)
        try:
            chunk = owner.draft_chunk(scheduler)
            self._draft_scale = max(1, chunk // max(1, scheduler.prefill_chunk))
            self.scoring = ScoringJob(owner.draft, seq.req.prompt_ids, start, keep_pct, backbone_pct, owner.settings, chunk)
        except Exception as exc:
            self._fall_back(exc)

    def ready(self) -> bool:
        """Whether its pieces run now (the dense prefix before ``start`` is prefilled first)."""
        return self.seq.prefilled >= self.start

    @property
    def active(self) -> bool:
        return self.scoring is not None or self.prefill is not None

    def next_cost(self) -> int:
        """The next piece's cost in the target's prompt tokens."""
        if self.prefill is not None:
            return self.prefill.next_cost()
        assert self.scoring is not None  # active: scoring, then the prefill
        return -(-self.scoring.next_cost() // self._draft_scale)

    def advance(self, overlap: bool = False) -> int:
        """One piece of work; its cost in the target's prompt tokens (0 after a fallback: the request goes on densely).
        ``overlap``: no row decodes, so the piece is launched without waiting for the device (``ScoringJob.advance``)."""
        tic = time.perf_counter()
        if self.prefill is None:
            assert self.scoring is not None  # active: scoring, then the prefill
            try:
                n = self.scoring.advance(overlap)
            except Exception as exc:
                self._fall_back(exc)
                return 0
            self.scoring_s += time.perf_counter() - tic
            if self.scoring.done:
                self._begin_prefill()
            return -(-n // self._draft_scale)
        n = self.prefill.advance(overlap)  # a fault here is the request's own prefill fault (its caches changed)
        self.prefill_s += time.perf_counter() - tic
        if self.prefill.done:
            self._finish()
        return n

    def _begin_prefill(self) -> None:
        seq, sched, scoring = self.seq, self.scheduler, self.scoring
        assert scoring is not None and scoring.kept is not None  # scoring is done
        if seq.prefill is None:
            seq.prefill = PrefillState()
        state = seq.prefill
        decode = sched.spec
        self.prefill = SparsePrefill(
            sched.model, seq.req.prompt_ids, scoring.kept, state, chunk_tokens=sched.prefill_chunk,
            head=getattr(decode, "head", None) if getattr(decode, "head_layers", 0) else None,
            hidden_state_mode=getattr(decode, "hidden_state_mode", "post_norm"),
        )
        self.scoring = None
        # Sparse states are never prefix-cache entries: no snapshot during this prefill.
        seq.plan = SnapshotPlan(None, {})

    def _finish(self) -> None:
        m, seq = self.owner.metrics, self.seq
        assert self.prefill is not None  # the sparse prefill is done
        scored, kept = seq.to_prefill - self.start, len(self.prefill.kept)
        m.requests += 1
        m.tokens_scored += scored
        m.tokens_kept += kept
        m.draft_tokens += seq.to_prefill + self.owner.settings.look_ahead
        m.scoring_s += self.scoring_s
        m.sparse_prefill_s += self.prefill_s
        seq.sparse = None
        if seq.specprefill_outcome is not None:
            seq.specprefill_outcome.update(engaged=True, reason="engaged", original_tokens=scored, selected_tokens=kept)
        logger.info("SpecPrefill %s: kept %d of %d prompt tokens (%.0f%%) after the first %d (dense; %d from the prefix cache), "
                    "scoring %.2f s, sparse prefill %.2f s", seq.rid, kept, scored, 100.0 * kept / max(scored, 1), self.start,
                    seq.cached_tokens, self.scoring_s, self.prefill_s)

    def _fall_back(self, exc: BaseException) -> None:
        self.scoring = None
        self.owner.metrics.fallbacks += 1
        self.seq.sparse = None
        if self.seq.specprefill_outcome is not None:
            self.seq.specprefill_outcome["reason"] = OUTCOME_REASONS["scoring_failed"]
        logger.warning("SpecPrefill scoring failed for %s (%s: %s): dense prefill", self.seq.rid, type(exc).__name__, exc)


def _parameters(model: nn.Module) -> int:
    leaves = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    return sum(v.size for _, v in leaves)
