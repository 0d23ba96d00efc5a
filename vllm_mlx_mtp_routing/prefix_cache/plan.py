"""A request's prefix-cache plan while it prefills: the lookup, where its chunks end, its snapshots.

The scheduler's call sites (text_engine/batch.py): ``SnapshotPlan.start`` when the request's
prefill begins (so requests that arrive together and share an uncached prefix find the snapshot
the first of them just took: prefill runs one request at a time, oldest first), ``cut`` when it
sizes a chunk, ``after_chunk`` after each chunk, ``after_abort`` when the request is aborted while it prefills,
``after_generation`` when the request finishes.

A long prefill keeps its progress: besides the chat's own positions, a ``progress`` snapshot every
``PROGRESS_TOKENS`` positions (fixed positions, so a prompt's chunks end there alone or batched, resumed or cold;
only in a prefill longer than that) and one where an aborted prefill stopped (a chunk end): a client that hangs up
and retries resumes there.
"""

from __future__ import annotations

import logging

from ..text_engine.batch_cache import BatchCache
from ..text_engine.row import Row
from ..text_engine.state import PrefillState
from .cache import PrefixCache
from .snapshot import from_batch_row

logger = logging.getLogger("vllm_mlx_mtp_routing.prefix_cache")

PROGRESS_TOKENS = 4096


class SnapshotPlan:
    def __init__(self, cache: PrefixCache | None, positions: dict[int, str]) -> None:
        self.cache = cache
        self.positions = positions  # prompt position -> kind, each > the restored prefix
        self._cuts = sorted(positions)

    @classmethod
    def start(cls, cache: PrefixCache | None, seq: Row) -> SnapshotPlan:
        """Look the prompt up among its cache salt's entries; a hit becomes the row's ``PrefillState`` (the text
        engine's insert API, validated as ``BatchScheduler.add(restored=...)`` does)."""
        prompt_ids = seq.req.cache_ids
        to_prefill = len(prompt_ids) - 1
        # A state restored by someone else (a sparse prefill) is left alone.
        if cache is None or to_prefill <= 0 or seq.prefilled or (seq.prefill is not None and seq.prefill.position):
            return cls(None, {})
        hit = cache.lookup(prompt_ids, to_prefill, seq.req.cache_salt)
        restored = 0
        if hit is not None:
            hit.state.check(len(prompt_ids))
            seq.prefill = hit.state
            seq.cached_tokens = restored = hit.length
            logger.debug("prefix cache hit for %s: %d of %d prompt tokens (%s)", seq.rid, hit.length, len(prompt_ids), hit.kind)
        positions: dict[int, str] = {}
        if to_prefill - restored > PROGRESS_TOKENS:  # a short prefill (a later turn's suffix) is not cut for them
            for pos in range(PROGRESS_TOKENS, to_prefill, PROGRESS_TOKENS):
                if pos > restored:
                    positions[pos] = "progress"
        for pos, kind in seq.req.snapshot_at:
            if restored < pos <= to_prefill:
                positions[pos] = kind
        if restored < to_prefill:
            positions.setdefault(to_prefill, "prompt")
        return cls(cache, positions)

    def snapshots_of(self, kind: str) -> list[int]:
        """The positions where a snapshot of this kind will be taken (none without a cache)."""
        return [p for p, k in self.positions.items() if k == kind] if self.cache is not None else []

    def cut(self, start: int, end: int) -> int:
        """The end of the chunk starting at ``start``: ``end`` or the first snapshot position before it."""
        for p in self._cuts:
            if start < p < end:
                return p
        return end

    def after_chunk(self, seq: Row, n: int) -> None:
        if self.cache is None:
            return
        self.cache.count_prefilled(n)
        kind = self.positions.get(seq.prefilled)
        if kind is not None:
            self._save(seq, kind)

    def after_abort(self, seq: Row) -> None:
        """Keep what an aborted dense prefill did (its caches end on a chunk end), unless a snapshot is there."""
        if self.cache is None or seq.sparse is not None or seq.prefill is None or seq.prefilled <= 0:
            return
        if seq.prefill.partial is not None:  # a chunk stopped between layers: its caches end at no one position
            return
        if seq.prefilled in self.positions or seq.prefilled <= seq.cached_tokens:
            return
        self._save(seq, "progress")

    def _save(self, seq: Row, kind: str) -> None:
        assert self.cache is not None and seq.prefill is not None  # seq.prefilled > 0: snapshot positions are past 0
        try:
            self.cache.save(seq.req.cache_ids, kind, seq.prefill, seq.req.cache_salt)
        except Exception:  # a snapshot is an optimisation: the request goes on without it
            logger.exception("prefix cache: snapshot at %d failed for %s", seq.prefilled, seq.rid)

    @staticmethod
    def after_generation(cache: PrefixCache, seq: Row, batch: BatchCache, i: int) -> None:
        """Keep a finished row's state (prompt + generated tokens but the last; all of them when a step launched ahead
        already fed the last one): the next turn of a conversation renders this reply into its prompt. Backbone only:
        with MTP, a hit on it restores no head state and the head skips those positions (only acceptance can suffer)."""
        held = batch.lengths()[i]
        tokens = [*seq.req.cache_ids, *seq.token_ids]
        if held > len(tokens) or held <= len(seq.req.prompt_ids) - 1:
            return
        # A whole prompt marked as a system prefix (a --warm-prompts entry) keeps that class.
        whole = any(kind == "system" and pos >= len(seq.req.prompt_ids) - 1 for pos, kind in seq.req.snapshot_at)
        try:
            # A media row's M-RoPE delta is its request's: the next turn's row takes it from its own images again.
            shift = seq.req.media.rope_delta if seq.req.media is not None else 0
            state = PrefillState(backbone=from_batch_row(batch.layers, i, shift), prefilled=held)
            cache.save(tokens, "system" if whole else "generation", state, seq.req.cache_salt)
        except Exception:
            logger.exception("prefix cache: end-of-generation snapshot failed for %s", seq.rid)
