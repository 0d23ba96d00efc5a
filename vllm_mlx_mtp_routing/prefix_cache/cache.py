"""The text path's prefix cache: lookups before prefill, snapshots at chosen positions.

The scheduler calls three things (text_engine/batch.py):

- ``lookup(prompt_ids, max_len, salt)`` when a request starts its prefill: the longest cached prefix
  restored into a fresh ``PrefillState`` (copy-on-hit: the entry is never written), or None;
- ``save(tokens, kind, state, salt)`` after a prefill chunk that ends at a snapshot position, and at the
  end of a generation from the finished row of the decode batch;
- ``stats()``.

A request's ``cache_salt`` keys both: its snapshots go to the salt's own space of the tree (and of the disk
tier), so a request with another salt, or none, never reads them (whether a prompt was seen shows in how
fast a request starts).

Gated-delta state cannot be cut back, so a hit resumes exactly where a snapshot was taken; the
positions are chosen from the chat structure (``boundaries.py``) and the prefill's chunks are cut
there, so snapshots cost no extra forward pass.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from ..text_engine.state import PrefillState
from . import snapshot
from .disk_tier import DiskTier
from .tree import Entry, PrefixTree

logger = logging.getLogger(__name__)


def space_of(salt: str | None) -> str | None:
    """The tree space of a request's cache salt: a digest, so that no file of the disk tier holds a salt."""
    return None if salt is None else hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class Hit:
    length: int
    state: PrefillState
    kind: str


class PrefixCache:
    def __init__(self, model: nn.Module, budget_bytes: int, *, with_head: bool = False, disk: DiskTier | None = None) -> None:
        """``with_head``: the decode strategy runs an MTP head, whose cache a hit restores too
        (where the snapshot has it), so the head continues right after the hit. ``disk``: a second
        tier that snapshots evicted from memory spill to (and system prefixes are written through
        to, so they survive a restart), read back on a hit longer than memory's."""
        self.model = model
        self.tree = PrefixTree(budget_bytes)
        self.with_head = with_head
        self.disk = disk
        self.disk_hits = 0
        if disk is not None:
            self.tree.on_evict = self._spill
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

    def lookup(self, tokens: Sequence[int], max_len: int, salt: str | None = None) -> Hit | None:
        self.lookups += 1
        space = space_of(salt)
        entry = self.tree.longest(tokens, max_len, space=space) if max_len > 0 else None
        if self.disk is not None:
            on_disk = self.disk.longest(tokens, max_len, space)
            if on_disk is not None and (entry is None or on_disk.length > entry.length):
                hit = self._from_disk(tokens, on_disk)
                if hit is not None:
                    return hit
        if entry is None:
            return None
        self.tree.pin(entry)  # in use while its arrays are read
        try:
            state = snapshot.restore([e.payload for e in entry.chain()], self.model.make_cache(), self.with_head)
        finally:
            self.tree.unpin(entry)
        self.tree.touch(entry)
        return self._hit(entry.length, state, entry.kind)

    def _hit(self, length: int, state: PrefillState, kind: str) -> Hit:
        self.hits += 1
        self.hit_tokens += length
        self.hits_by_kind[kind] = self.hits_by_kind.get(kind, 0) + 1
        return Hit(length, state, kind)

    def _from_disk(self, tokens: Sequence[int], on_disk: Entry) -> Hit | None:
        assert self.disk is not None  # called for a disk hit only
        snap = self.disk.load(on_disk)
        if snap is None:
            return None
        state = snapshot.restore([snap], self.model.make_cache(), self.with_head)
        # Back in memory (whole, no base), where the conversation's next snapshots can extend it.
        self.tree.insert(tokens, snap.length, on_disk.kind, snap, space=on_disk.space)
        self.disk_hits += 1
        return self._hit(snap.length, state, on_disk.kind)

    def _whole(self, entry: Entry) -> snapshot.Snapshot:
        """An entry's snapshot with its bases folded in (KV from position 0)."""
        if entry.base is None:  # taken without a base: its KV already starts at position 0
            return entry.payload
        state = snapshot.restore([e.payload for e in entry.chain()], self.model.make_cache(), True)
        return snapshot.take(state, None)

    def _spill(self, entry: Entry) -> None:
        """The tree is evicting ``entry`` from memory: keep it on disk (if it is not there yet)."""
        assert self.disk is not None  # the eviction hook is set only with a disk tier
        tokens = self.tree.tokens(entry)
        if self.disk.has(tokens, entry.length, entry.space):
            return
        try:
            self.disk.save(tokens, entry.kind, self._whole(entry), entry.space)
        except Exception:  # noqa: BLE001 - the eviction goes on; only the disk copy is lost
            logger.exception("prefix cache: spilling a %d-token snapshot to disk failed", entry.length)

    def count_prefilled(self, n: int) -> None:
        self.prefilled_tokens += n

    def save(self, tokens: Sequence[int], kind: str, state: PrefillState, salt: str | None = None) -> bool:
        """Snapshot a state holding tokens[:state.prefilled] (in ``salt``'s space); False when it is not kept
        (already there, no room)."""
        length = state.prefilled
        if length <= 0 or self.tree.budget_bytes <= 0:
            return False
        space = space_of(salt)
        existing = self.tree.get(tokens, length, space)
        if existing is not None:
            self.tree.insert(tokens, length, kind, existing.payload, space=space)  # refreshed, its class maybe raised
            return False
        base = self.tree.longest(tokens, length - 1, space=space)
        if base is not None:
            self.tree.pin(base)
        try:
            snap = snapshot.take(state, base.payload if base is not None else None)
            entry = self.tree.insert(tokens, length, kind, snap, base=base, space=space)
        finally:
            if base is not None:
                self.tree.unpin(base)
        if entry is None:
            logger.debug("prefix cache: a %d-token %s snapshot (%d bytes) does not fit", length, kind, snap.nbytes)
            if self.disk is not None and not self.disk.has(tokens, length, space):
                self.disk.save(tokens, kind, snap if base is None else snapshot.take(state, None), space)
            return False
        self.saved += 1
        if self.disk is not None and kind == "system" and not self.disk.has(tokens, length, space):
            self.disk.save(tokens, kind, self._whole(entry), space)  # the longest-lived prefixes survive a restart
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
            "disk_hits": self.disk_hits,
            "disk": self.disk.stats() if self.disk is not None else {"enabled": False},
        }
