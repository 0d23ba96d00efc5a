"""Snapshots of a request's single-sequence caches, and their restore into fresh ones.

A request's prefill state is ``model.make_cache()`` (mlx-lm ``KVCache`` for the full-attention
layers, ``ArraysCache`` [conv, recurrent] for the gated-delta layers) plus the decode strategy's
scratch dict (MTP: the head's ``KVCache`` list and the last hidden state). A snapshot at L keeps

- the attention KV of [start, L), where ``start`` is the length of the base snapshot it extends
  (0: none), per attention layer and per KV list of the scratch dict (whose own offsets, e.g. the
  MTP head's L - 1, are recorded per list);
- the gated-delta conv and recurrent state at L, and every plain array of the scratch dict.

Every array is a copy, evaluated at once: never a view into the request's buffers (a KV buffer is
reserved in 256-token steps; the conv state is a slice of the chunk's projection), nor a lazy graph
that would keep them alive (upstream vllm-mlx #642: stored entries pinned live batch buffers).
A restore hands the caches new array objects: mlx-lm's ``KVCache`` writes into ``keys`` in place
(``__setitem__``), which must never reach a stored array.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache


def _own(x: mx.array) -> mx.array:
    return mx.contiguous(x)


@dataclass
class _KV:
    start: int
    end: int
    keys: mx.array | None
    values: mx.array | None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def _kv_segment(c: KVCache, start: int) -> _KV:
    end = c.offset
    if start > end:
        raise ValueError(f"KV segment start {start} past the cache's {end} tokens")
    if end == start or c.keys is None:
        return _KV(start, end, None, None)
    return _KV(start, end, _own(c.keys[..., start:end, :]), _own(c.values[..., start:end, :]))


@dataclass
class Snapshot:
    length: int
    layers: list[_KV | list[mx.array]]  # per model layer: a KV segment or the gated-delta state
    row: dict[str, list[_KV] | mx.array] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = 0
        for part in [*self.layers, *self.row.values()]:
            if isinstance(part, _KV):
                n += part.nbytes
            elif isinstance(part, list):
                n += sum(p.nbytes for p in part)
            else:
                n += part.nbytes
        return n

    @property
    def row_keys(self) -> frozenset[str]:
        return frozenset(self.row)

    def arrays(self) -> list[mx.array]:
        out: list[mx.array] = []
        for part in [*self.layers, *self.row.values()]:
            for p in part if isinstance(part, list) else [part]:
                if isinstance(p, _KV):
                    out += [a for a in (p.keys, p.values) if a is not None]
                else:
                    out.append(p)
        return out


def take(cache: list[Any], row: dict[str, Any], length: int, base: Snapshot | None) -> Snapshot:
    """Snapshot of a request's caches holding exactly ``length`` tokens, as a delta on ``base``."""
    start = 0 if base is None else base.length
    layers: list[_KV | list[mx.array]] = []
    for i, c in enumerate(cache):
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
    snap_row: dict[str, list[_KV] | mx.array] = {}
    for key, value in row.items():
        if isinstance(value, mx.array):
            snap_row[key] = _own(value)
        elif isinstance(value, list) and all(isinstance(c, KVCache) for c in value):
            base_kv = base.row.get(key) if base is not None else None
            starts = [kv.end for kv in base_kv] if isinstance(base_kv, list) else [0] * len(value)
            snap_row[key] = [_kv_segment(c, s) for c, s in zip(value, starts)]
        else:
            raise TypeError(f"no snapshot for decode state {key!r} ({type(value).__name__})")
    snap = Snapshot(length, layers, snap_row)
    mx.eval(snap.arrays())
    return snap


def _join_kv(parts: list[_KV]) -> KVCache:
    c = KVCache()
    pos = 0
    keys, values = [], []
    for p in parts:
        if p.start != pos:
            raise RuntimeError(f"snapshot chain has a gap at {pos} (next segment starts at {p.start})")
        pos = p.end
        if p.keys is not None:
            keys.append(p.keys)
            values.append(p.values)
    if keys:
        # concatenate (or, for one segment, a slice) gives new array objects: see the docstring.
        c.keys = mx.concatenate(keys, axis=2) if len(keys) > 1 else keys[0][...]
        c.values = mx.concatenate(values, axis=2) if len(values) > 1 else values[0][...]
        c.offset = pos
    return c


def restore(chain: list[Snapshot], fresh: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Fill ``fresh`` (``model.make_cache()``) from a snapshot chain (base first); returns it and the
    decode strategy's scratch dict."""
    last = chain[-1]
    for i, c in enumerate(fresh):
        if isinstance(c, KVCache):
            joined = _join_kv([s.layers[i] for s in chain])
            c.keys, c.values, c.offset = joined.keys, joined.values, joined.offset
        else:
            c.cache = [a[...] for a in last.layers[i]]
    row: dict[str, Any] = {}
    for key, value in last.row.items():
        if isinstance(value, list):
            row[key] = [_join_kv([s.row[key][j] for s in chain]) for j in range(len(value))]
        else:
            row[key] = value[...]
    return fresh, row


def from_batch_row(layers: list[Any], i: int) -> list[Any]:
    """Row i of a decode batch's caches (``BatchCache.layers``) as single-sequence caches (copies)."""
    from ..text_engine.batch_cache import RaggedKVCache

    out: list[Any] = []
    for c in layers:
        if isinstance(c, RaggedKVCache):
            out.append(c.extract(i))
        else:
            a = ArraysCache(size=len(c.cache))
            a.cache = [_own(x[i : i + 1]) for x in c.cache]
            out.append(a)
    return out
