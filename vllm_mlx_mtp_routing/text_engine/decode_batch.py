"""The decode batch: its rows and every batch cache, kept in step.

A row's place in every batch cache is its index in ``DecodeBatch.rows``: the backbone's ``BatchCache`` rows and the
MTP head's ``RaggedKVCache`` rows follow that list, and only ``DecodeBatch`` changes it (``insert``, ``filter``,
``clear``), so the caches cannot drift out of step with the rows.
"""

from __future__ import annotations

import mlx.nn as nn

from ..model.mlx_lm_internals import KVCache
from .batch_cache import BatchCache, RaggedKVCache
from .row import Row
from .spec.head_cache import PositionedKVCache
from .state import PrefillState


class DecodeBatch:
    """The decode batch: its rows and every batch cache, row i of each cache being ``rows[i]``.

    ``backbone``: the model's per-layer batch caches; ``head``: the MTP head's attention caches (one
    ``RaggedKVCache`` per head layer; empty without a head). ``version`` changes whenever rows join
    or leave (a strategy timing steps uses it to skip the first step after a change).
    """

    def __init__(self, model: nn.Module, head_layers: int = 0) -> None:
        self._model = model
        self._head_layers = head_layers
        self.rows: list[Row] = []
        self.backbone = BatchCache(model)
        self.head: list[RaggedKVCache] = [RaggedKVCache() for _ in range(head_layers)]
        self.version = 0

    def __len__(self) -> int:
        return len(self.rows)

    def insert(self, row: Row, state: PrefillState) -> None:
        """Append ``row`` with its single-sequence caches as the last row of every batch cache."""
        backbone = state.backbone if state.backbone is not None else self._model.make_cache()
        kv = next((c for c in backbone if isinstance(c, KVCache)), None)
        held = 0 if kv is None or kv.keys is None else kv.offset
        self.backbone.add_row(backbone, shift=state.next_position - held + state.rope_delta)
        if self.head:
            head = state.head if state.head is not None else [KVCache() for _ in self.head]
            if len(head) != len(self.head):
                raise ValueError(f"{len(head)} head caches for a head of {len(self.head)} layers")
            for c, rc in zip(self.head, head):  # a head that started past 0 skips the positions before
                c.add_row(rc.held(), rc.start) if isinstance(rc, PositionedKVCache) else c.add_row(rc)
        self.rows.append(row)
        self.version += 1

    def filter(self, keep: list[Row]) -> None:
        """Keep only these rows, in this order, in the row list and every cache."""
        index = {id(r): i for i, r in enumerate(self.rows)}
        idx = [index[id(r)] for r in keep]
        self.backbone.filter(idx)
        for c in self.head:
            c.filter(idx)
        self.rows = list(keep)
        self.version += 1

    def clear(self) -> None:
        """Drop every row (after a fault that may have left the caches half-updated)."""
        self.rows = []
        self.backbone = BatchCache(self._model)
        self.head = [RaggedKVCache() for _ in range(self._head_layers)]
        self.version += 1

    @property
    def nbytes(self) -> int:
        return self.backbone.nbytes + sum(c.nbytes for c in self.head)

    def kv_bytes(self) -> tuple[int, int]:
        """(held, owned by rows) bytes of attention KV, backbone and head (held counts free blocks)."""
        caches = [c for c in self.backbone.layers if isinstance(c, RaggedKVCache)] + self.head
        return sum(c.nbytes for c in caches), sum(c.used_bytes for c in caches)
