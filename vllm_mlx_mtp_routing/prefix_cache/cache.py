"""The text path's prefix cache: lookups before prefill, snapshots at chosen positions.

The scheduler calls three things (text_engine/batch.py):

- ``lookup(prompt_ids, max_len)`` when a request starts its prefill: the longest cached prefix
  restored into a fresh ``PrefillState`` (copy-on-hit: the entry is never written), or None;
- ``save(tokens, kind, state)`` after a prefill chunk that ends at a snapshot position, and at the
  end of a generation from the finished row of the decode batch;
- ``stats()``.

Gated-delta state cannot be cut back, so a hit resumes exactly where a snapshot was taken; the
positions are chosen from the chat structure (``boundaries.py``) and the prefill's chunks are cut
there, so snapshots cost no extra forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.nn as nn

from . import snapshot
from .tree import PrefixTree

if TYPE_CHECKING:  # the text engine imports this package (plan.py)
    from ..text_engine.rows import PrefillState

logger = logging.getLogger(__name__)


@dataclass
class Hit:
    length: int
    state: PrefillState
    kind: str


class PrefixCache:
    def __init__(self, model: nn.Module, budget_bytes: int, *, with_head: bool = False) -> None:
        """``with_head``: the decode strategy runs an MTP head, whose cache a hit restores too
        (where the snapshot has it), so the head continues right after the hit."""
        self.model = model
        self.tree = PrefixTree(budget_bytes)
        self.with_head = with_head
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0
        self.prefilled_tokens = 0
        self.saved = 0
        self.hits_by_kind: dict[str, int] = {}

    @property
    def budget_bytes(self) -> int:
        return self.tree.budget_bytes

    @property
    def nbytes(self) -> int:
        return self.tree.nbytes

    def lookup(self, tokens: Sequence[int], max_len: int) -> Hit | None:
        self.lookups += 1
        entry = self.tree.longest(tokens, max_len) if max_len > 0 else None
        if entry is None:
            return None
        self.tree.pin(entry)  # in use while its arrays are read
        try:
            state = snapshot.restore([e.payload for e in entry.chain()], self.model.make_cache(), self.with_head)
        finally:
            self.tree.unpin(entry)
        self.tree.touch(entry)
        self.hits += 1
        self.hit_tokens += entry.length
        self.hits_by_kind[entry.kind] = self.hits_by_kind.get(entry.kind, 0) + 1
        return Hit(entry.length, state, entry.kind)

    def count_prefilled(self, n: int) -> None:
        self.prefilled_tokens += n

    def save(self, tokens: Sequence[int], kind: str, state: PrefillState) -> bool:
        """Snapshot a state holding tokens[:state.prefilled]; False when it is not kept (already
        there, no room)."""
        length = state.prefilled
        if length <= 0 or self.tree.budget_bytes <= 0:
            return False
        existing = self.tree.get(tokens, length)
        if existing is not None:
            self.tree.insert(tokens, length, kind, existing.payload)  # refreshed, its class maybe raised
            return False
        base = self.tree.longest(tokens, length - 1)
        if base is not None:
            self.tree.pin(base)
        try:
            snap = snapshot.take(state, base.payload if base is not None else None)
            entry = self.tree.insert(tokens, length, kind, snap, base=base)
        finally:
            if base is not None:
                self.tree.unpin(base)
        if entry is None:
            logger.debug("prefix cache: a %d-token %s snapshot (%d bytes) does not fit", length, kind, snap.nbytes)
            return False
        self.saved += 1
        return True

    def clear(self) -> None:
        self.tree.clear()

    def stats(self) -> dict[str, Any]:
        seen = self.hit_tokens + self.prefilled_tokens
        return {
            "enabled": True,
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_tokens": self.hit_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "token_hit_rate": round(self.hit_tokens / seen, 4) if seen else 0.0,
            "hits_by_kind": dict(sorted(self.hits_by_kind.items())),
            "entries": len(self.tree),
            "bytes": self.tree.nbytes,
            "budget_bytes": self.tree.budget_bytes,
            "snapshots_saved": self.saved,
            "evictions": self.tree.stats.evictions,
            "rejected": self.tree.stats.rejected,
        }
