"""A request's prefix-cache plan while it prefills: the lookup, where its chunks end, its snapshots.

The scheduler's call sites (text_engine/batch.py): ``SnapshotPlan.start`` when the request's
prefill begins (so requests that arrive together and share an uncached prefix find the snapshot
the first of them just took: prefill runs one request at a time, oldest first), ``cut`` when it
sizes a chunk, ``after_chunk`` after each chunk, ``after_generation`` when the request finishes.
"""

from __future__ import annotations

import logging
from typing import Any

from .cache import PrefixCache
from .snapshot import from_batch_row

logger = logging.getLogger("vllm_mlx_mtp_routing.prefix_cache")


class SnapshotPlan:
    def __init__(self, cache: PrefixCache | None, positions: dict[int, str]) -> None:
        self.cache = cache
        self.positions = positions  # prompt position -> kind, each > the restored prefix
        self._cuts = sorted(positions)

    @classmethod
    def start(cls, cache: PrefixCache | None, prompt_ids: list[int], snapshot_at: list[tuple[int, str]], seq: Any) -> SnapshotPlan:
        """Look the prompt up, restore a hit into ``seq`` (its cache, decode scratch, prefilled)."""
        if cache is None:
            return cls(None, {})
        to_prefill = len(prompt_ids) - 1
        if to_prefill <= 0:
            return cls(None, {})
        hit = cache.lookup(prompt_ids, to_prefill)
        restored = 0
        if hit is not None:
            seq.cache, seq.strategy_state = hit.cache, hit.row
            seq.prefilled = seq.cached_tokens = restored = hit.length
            logger.debug("prefix cache hit for %s: %d of %d prompt tokens (%s)", seq.rid, hit.length, len(prompt_ids), hit.kind)
        positions: dict[int, str] = {}
        for pos, kind in snapshot_at:
            if restored < pos < to_prefill:
                positions[pos] = kind
        if restored < to_prefill:
            positions[to_prefill] = "prompt"
        cache.count_prefilled(to_prefill - restored)
        return cls(cache, positions)

    def cut(self, start: int, end: int) -> int:
        """The end of the chunk starting at ``start``: ``end`` or the first snapshot position before it."""
        for p in self._cuts:
            if start < p < end:
                return p
        return end

    def after_chunk(self, seq: Any, n: int) -> None:
        kind = self.positions.get(seq.prefilled)
        if self.cache is None or kind is None:
            return
        try:
            self.cache.save(seq.req.prompt_ids, seq.prefilled, kind, seq.cache, seq.strategy_state)
        except Exception:  # a snapshot is an optimisation: the request goes on without it
            logger.exception("prefix cache: snapshot at %d failed for %s", seq.prefilled, seq.rid)

    @staticmethod
    def after_generation(cache: PrefixCache, seq: Any, batch: Any, i: int) -> None:
        """Keep a finished row's state (prompt + generated tokens but the last): the next turn of a
        conversation renders this reply into its prompt. Not with a decode strategy that keeps
        per-row scratch (MTP): its head state is not in single-sequence form inside the batch."""
        if cache.row_keys:
            return
        held = batch.lengths()[i]
        tokens = [*seq.req.prompt_ids, *seq.token_ids]
        if held != len(tokens) - 1 or held <= len(seq.req.prompt_ids) - 1:
            return
        try:
            cache.save(tokens, held, "generation", from_batch_row(batch.layers, i), {})
        except Exception:
            logger.exception("prefix cache: end-of-generation snapshot failed for %s", seq.rid)
