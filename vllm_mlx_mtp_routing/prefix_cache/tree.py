"""A token-prefix tree (radix tree over token ids) whose entries are cache snapshots.

Pure bookkeeping, no MLX: an entry's payload only has to tell its size (``nbytes``). An entry at
length L stands for the model state after the first L tokens of its path. Payloads may be stored as
deltas: an entry names a ``base`` entry (a shorter prefix on its path) whose payload it extends
(the attention KV of [base.length, L)), so a conversation's snapshots share their common KV instead
of holding one copy each. A base therefore lives at least as long as its dependents: only entries
without dependents are evicted (leaf-first), least recently used first within a retention class,
the classes of short-lived snapshots (the end of a generation or of a prompt) before the start of a
message, the system/tools block last. Pinned entries (being restored or extended right now) are
never evicted.

Entries live in spaces: each space (None, or a request's cache salt as the cache keys it) has its own root, so
a lookup never reaches an entry of another space, whatever the tokens. The budget is shared; a space's root
goes with its last entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Where a snapshot sits in a chat; also its retention class (higher: kept longer).
KINDS = ("progress", "generation", "prompt", "message", "system")
_RETENTION = {"progress": 0, "generation": 0, "prompt": 0, "message": 1, "system": 2}


class Payload(Protocol):
    @property
    def nbytes(self) -> int: ...


class _Node:
    __slots__ = ("parent", "edge", "children", "entry", "depth")

    def __init__(self, parent: _Node | None, edge: tuple[int, ...], depth: int) -> None:
        self.parent = parent
        self.edge = edge  # tokens from the parent's end to this node's end
        self.children: dict[int, _Node] = {}
        self.entry: Entry | None = None
        self.depth = depth  # tokens from the root to this node's end


@dataclass(eq=False)
class Entry:
    length: int
    kind: str
    payload: Any
    base: Entry | None
    nbytes: int
    space: str | None = None
    last_used: int = 0
    pins: int = 0
    dependents: int = 0
    node: _Node | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.node is not None

    def chain(self) -> list[Entry]:
        """This entry and its bases, shortest first: the payloads a restore concatenates."""
        out: list[Entry] = []
        e: Entry | None = self
        while e is not None:
            out.append(e)
            e = e.base
        return out[::-1]


@dataclass
class TreeStats:
    inserts: int = 0
    evictions: int = 0
    rejected: int = 0  # inserts that could not fit even after evicting everything evictable


class PrefixTree:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._roots: dict[str | None, _Node] = {}
        self._entries: set[Entry] = set()
        self._clock = itertools.count(1)
        self.stats = TreeStats()
        # Called with an entry about to be evicted (alive, its payload and bases intact); a second tier
        # keeps it from there. Not called by clear().
        self.on_evict: Callable[[Entry], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return sorted(self._entries, key=lambda e: e.last_used)

    # -- lookup ------------------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int], max_len: int, space: str | None) -> list[_Node]:
        """The nodes whose whole edge matches tokens, the space's root first, down to depth max_len (none: the
        space has no entry)."""
        node = self._roots.get(space)
        if node is None:
            return []
        path = [node]
        while node.depth < max_len:
            child = node.children.get(tokens[node.depth])
            if child is None or child.depth > max_len:
                break
            d = node.depth
            if tuple(tokens[d : child.depth]) != child.edge:
                break
            path.append(child)
            node = child
        return path

    def longest(
        self, tokens: Sequence[int], max_len: int | None = None, accept: Callable[[Entry], bool] | None = None,
        space: str | None = None,
    ) -> Entry | None:
        """The longest entry of ``space`` that is a prefix of tokens (length <= max_len) and passes ``accept``."""
        max_len = len(tokens) if max_len is None else min(max_len, len(tokens))
        for node in reversed(self._walk(tokens, max_len, space)):
            e = node.entry
            if e is not None and (accept is None or accept(e)):
                return e
        return None

    def get(self, tokens: Sequence[int], length: int, space: str | None = None) -> Entry | None:
        """The entry of ``space`` at exactly tokens[:length], if any."""
        path = self._walk(tokens, length, space) if length <= len(tokens) else []
        return path[-1].entry if path and path[-1].depth == length else None

    def tokens(self, entry: Entry) -> list[int]:
        """The token ids of a live entry's prefix (its path from the root)."""
        node, parts = entry.node, []
        if node is None:
            raise ValueError("entry is not in the tree")
        while (parent := node.parent) is not None:  # up to its space's root
            parts.append(node.edge)
            node = parent
        return [t for edge in reversed(parts) for t in edge]

    def touch(self, entry: Entry) -> None:
        """Mark an entry (and the bases a restore reads through it) as just used."""
        t = next(self._clock)
        for e in entry.chain():
            e.last_used = t

    def pin(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        if entry.pins <= 0:
            raise RuntimeError("unpin without pin")
        entry.pins -= 1

    # -- insert and evict -----------------------------------------------------------------------

    def _node_for(self, tokens: Sequence[int], length: int, space: str | None) -> _Node:
        """The node of ``space`` at exactly tokens[:length], splitting an edge if needed."""
        node = self._roots.setdefault(space, _Node(None, (), 0))
        while node.depth < length:
            d = node.depth
            child = node.children.get(tokens[d])
            if child is None:
                new = _Node(node, tuple(tokens[d:length]), length)
                node.children[tokens[d]] = new
                return new
            # How far the child's edge agrees with tokens (and stays within length).
            n, limit = 0, min(len(child.edge), length - d)
            while n < limit and child.edge[n] == tokens[d + n]:
                n += 1
            if n == len(child.edge):
                node = child
                continue
            mid = _Node(node, child.edge[:n], d + n)
            node.children[tokens[d]] = mid
            child.edge = child.edge[n:]
            child.parent = mid
            mid.children[child.edge[0]] = child
            node = mid
        return node

    def insert(
        self, tokens: Sequence[int], length: int, kind: str, payload: Any, base: Entry | None = None, space: str | None = None
    ) -> Entry | None:
        """Store ``payload`` for tokens[:length] in ``space``; None if it cannot fit the budget.

        ``base`` (a live entry on the same path, shorter) is what the payload extends. An entry
        already at this prefix is kept (refreshed, its kind raised if this one is kept longer).
        """
        if kind not in _RETENTION:
            raise ValueError(f"unknown snapshot kind {kind!r}")
        if not 0 < length <= len(tokens):
            raise ValueError(f"length {length} out of range for {len(tokens)} tokens")
        if base is not None and (not base.alive or base.length >= length or base.space != space):
            raise ValueError("base must be a live, shorter entry of the same space")
        existing = self.get(tokens, length, space)
        if existing is not None:
            if _RETENTION[kind] > _RETENTION[existing.kind]:
                existing.kind = kind
            self.touch(existing)
            return existing
        size = int(payload.nbytes)
        if base is not None:
            self.pin(base)  # eviction below must not take the base away
        try:
            if not self._make_room(size):
                self.stats.rejected += 1
                return None
        finally:
            if base is not None:
                self.unpin(base)
        node = self._node_for(tokens, length, space)
        entry = Entry(length=length, kind=kind, payload=payload, base=base, nbytes=size, space=space, node=node)
        node.entry = entry
        if base is not None:
            base.dependents += 1
        self._entries.add(entry)
        self.nbytes += size
        self.stats.inserts += 1
        self.touch(entry)
        return entry

    def _evictable(self) -> list[Entry]:
        return [e for e in self._entries if e.dependents == 0 and e.pins == 0]

    def _make_room(self, size: int) -> bool:
        if size > self.budget_bytes:
            return False
        while self.nbytes + size > self.budget_bytes:
            victims = self._evictable()
            if not victims:
                return False
            self._remove(min(victims, key=lambda e: (_RETENTION[e.kind], e.last_used)))
            self.stats.evictions += 1
        return True

    def evict_to(self, budget_bytes: int) -> int:
        """Evict until the tree holds at most budget_bytes (or nothing is evictable); bytes freed."""
        before = self.nbytes
        while self.nbytes > budget_bytes:
            victims = self._evictable()
            if not victims:
                break
            self._remove(min(victims, key=lambda e: (_RETENTION[e.kind], e.last_used)))
            self.stats.evictions += 1
        return before - self.nbytes

    def drop(self, entry: Entry) -> None:
        """Remove one entry that nothing extends (a second tier's damaged file, say)."""
        if entry.alive:
            if entry.dependents:
                raise ValueError("an entry other entries extend cannot be dropped")
            self._remove(entry)

    def clear(self) -> None:
        for e in list(self._entries):
            e.node = None
            e.payload = None
        self._entries.clear()
        self._roots = {}
        self.nbytes = 0

    def _remove(self, entry: Entry) -> None:
        node = entry.node
        assert node is not None and node.entry is entry
        if self.on_evict is not None:
            self.on_evict(entry)
        node.entry = None
        entry.node = None
        entry.payload = None
        self._entries.discard(entry)
        self.nbytes -= entry.nbytes
        if entry.base is not None:
            entry.base.dependents -= 1
        top = self._prune(node)
        if top.parent is None and not top.children:
            self._roots.pop(entry.space, None)  # the space's last entry: many salts leave no empty roots behind

    def _prune(self, node: _Node) -> _Node:
        """Drop entry-less leaves and merge entry-less single-child nodes into their child; the node it stopped at."""
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[node.edge[0]] = child
        return node
