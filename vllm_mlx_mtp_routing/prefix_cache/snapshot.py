"""Snapshots of a request's single-sequence caches, and their restore into fresh ones.

A request's prefill-stage state is the text engine's ``PrefillState``: ``model.make_cache()``
(mlx-lm ``KVCache`` for the full-attention layers, ``ArraysCache`` [conv, recurrent] for the
gated-delta layers) and, with MTP, the head's ``KVCache`` per layer (L - 1 pairs) and the hidden
state at L - 1. A snapshot at L keeps

- the attention KV of [start, L), where ``start`` is the length of the base snapshot it extends
  (0: none), per attention layer, and likewise the MTP head's KV;
- the gated-delta conv and recurrent state at L and the head's last hidden state.

Every array is a copy, evaluated at once: never a view into the request's buffers (a KV buffer is
reserved in 256-token steps; the conv state is a slice of the chunk's projection), nor a lazy graph
that would keep them alive (upstream vllm-mlx #642: stored entries pinned live batch buffers).
A restore hands the caches new array objects: mlx-lm's ``KVCache`` writes into ``keys`` in place
(``__setitem__``), which must never reach a stored array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from ..text_engine.batch_cache import RaggedKVCache
from ..text_engine.state import PrefillState


def _own(x: mx.array) -> mx.array:
    return mx.contiguous(x)


@dataclass
class KVSegment:
    """Positions [start, end) of one attention layer's keys and values (None: no keys there); the disk tier writes and
    reads them as they are."""

    start: int
    end: int
    keys: mx.array | None
    values: mx.array | None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes


def _kv_segment(c: KVCache, start: int) -> KVSegment:
    end = c.offset
    if start > end:
        raise ValueError(f"KV segment start {start} past the cache's {end} tokens")
    if end == start or c.keys is None or c.values is None:
        return KVSegment(start, end, None, None)
    return KVSegment(start, end, _own(c.keys[..., start:end, :]), _own(c.values[..., start:end, :]))


@dataclass
class Snapshot:
    length: int
    layers: list[KVSegment | list[mx.array]]  # per model layer: a KV segment or the gated-delta state
    head: list[KVSegment] | None = None  # the MTP head's KV segments (its caches hold length - 1 pairs)
    head_hidden: mx.array | None = None  # [1, 1, H]: the hidden state at length - 1

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        out: list[mx.array] = []
        for part in [*self.layers, *(self.head or [])]:
            if isinstance(part, KVSegment):
                out += [a for a in (part.keys, part.values) if a is not None]
            else:
                out += part
        if self.head_hidden is not None:
            out.append(self.head_hidden)
        return out


def take(state: PrefillState, base: Snapshot | None) -> Snapshot:
    """Snapshot of a request's prefill-stage caches (exactly ``state.prefilled`` tokens), as a delta
    on ``base`` (a snapshot of a prefix of the same tokens)."""
    length = state.prefilled
    if state.position is not None and state.position != length:
        raise ValueError("a sparse prefill's state has no exact prefix snapshot")
    start = 0 if base is None else base.length
    if state.backbone is None:
        raise ValueError("no backbone caches to snapshot")
    layers: list[KVSegment | list[mx.array]] = []
    for i, c in enumerate(state.backbone):
        if isinstance(c, KVCache):
            if c.offset != length:
                raise ValueError(f"layer {i} holds {c.offset} tokens, not {length}")
            layers.append(_kv_segment(c, start))
        elif isinstance(c, ArraysCache):
            if c.cache[0] is None:
                raise ValueError("a gated-delta layer has no state yet")
            layers.append([_own(a) for a in c.cache])
        else:
            raise TypeError(f"no snapshot for cache type {type(c).__name__}")
    head = None
    # A head that started past position 0 (text_engine.head_cache: its prompt window, or after a
    # restore without it) has no segments from 0: it is not kept.
    if state.head is not None and state.head_hidden is not None and not any(hasattr(c, "start") for c in state.head):
        # The head's segments extend the base's only where the base has them; else from 0.
        starts = [kv.end for kv in base.head] if base is not None and base.head is not None else [0] * len(state.head)
        head = [_kv_segment(c, s) for c, s in zip(state.head, starts)]
    hidden = _own(state.head_hidden) if head is not None and state.head_hidden is not None else None
    snap = Snapshot(length, layers, head, hidden)
    mx.eval(snap.arrays())
    return snap


def _join_kv(parts: list[KVSegment]) -> KVCache:
    c = KVCache()
    pos = 0
    keys: list[mx.array] = []
    values: list[mx.array] = []
    for p in parts:
        if p.start != pos:
            raise RuntimeError(f"snapshot chain has a gap at {pos} (next segment starts at {p.start})")
        pos = p.end
        if p.keys is not None and p.values is not None:
            keys.append(p.keys)
            values.append(p.values)
    if keys:
        # New array objects (see the docstring), with one allocation step of room after the restored positions: the
        # suffix's first chunk then writes in place, where a buffer holding exactly the prefix is copied whole to grow.
        c.keys, c.values = (mx.concatenate([*xs, mx.zeros((*xs[0].shape[:2], KVCache.step, xs[0].shape[3]), xs[0].dtype)],
                                           axis=2) for xs in (keys, values))
        c.offset = pos
    return c


def _head_parts(chain: list[Snapshot], j: int) -> list[KVSegment] | None:
    """Head layer j's segments back to position 0 through the chain, or None where it breaks."""
    head = chain[-1].head
    assert head is not None  # restore calls this only for a snapshot with the head's segments
    parts = [head[j]]
    for s in reversed(chain[:-1]):
        if parts[0].start == 0:
            break
        if s.head is not None and s.head[j].end == parts[0].start:
            parts.insert(0, s.head[j])
    return parts if parts[0].start == 0 else None


def restore(chain: list[Snapshot], fresh: list[Any], with_head: bool) -> PrefillState:
    """A ``PrefillState`` (the text engine's insert API) from a snapshot chain (base first), its
    backbone in ``fresh`` (``model.make_cache()``). Without the head's state (a snapshot taken
    without MTP, or ``with_head`` False) the head skips those positions."""
    last = chain[-1]
    for i, c in enumerate(fresh):
        if isinstance(c, KVCache):
            joined = _join_kv([cast(KVSegment, s.layers[i]) for s in chain])
            c.keys, c.values, c.offset = joined.keys, joined.values, joined.offset
        else:
            c.cache = [a[...] for a in cast("list[mx.array]", last.layers[i])]
    state = PrefillState(backbone=fresh, prefilled=last.length)
    if with_head and last.head is not None:
        parts = [_head_parts(chain, j) for j in range(len(last.head))]
        if all(p is not None for p in parts):
            state.head = [_join_kv(p) for p in parts if p is not None]
            assert last.head_hidden is not None  # a snapshot with the head's segments has its hidden state
            state.head_hidden = last.head_hidden[...]
    return state


def from_batch_row(layers: list[Any], i: int, shift: int = 0) -> list[Any]:
    """Row i of a decode batch's caches (``BatchCache.layers``) as single-sequence caches (copies); ``shift``: its
    position shift, re-applied when restored (a media row's M-RoPE delta)."""
    out: list[Any] = []
    for c in layers:
        if isinstance(c, RaggedKVCache):
            out.append(c.extract(i, shift))
        else:
            a = ArraysCache(size=len(c.cache))
            a.cache = [_own(x[i : i + 1]) for x in c.cache]  # type: ignore[misc]  # mlx-lm infers list[None]
            out.append(a)
    return out
