"""The MTP head's prefill cache when the head starts past position 0.

The head takes only the prompt's last pairs in the prefill (``MTPDecode(prompt_pairs=...)``), or
continues a prefix restored without its pairs. Its first pair then sits at position ``start``: its
keys are rotated there (attention rotates by ``offset``), while only the pairs from ``start`` on
are held. At the row's join the keys go into the decode batch's ``RaggedKVCache`` as a row that
skips ``start`` positions, so every pair keeps its own position, as after a resume.
"""

from __future__ import annotations

import mlx.core as mx

from ...model.mlx_lm_internals import KVCache


class PositionedKVCache(KVCache):
    """mlx-lm's single-sequence ``KVCache`` holding the keys of positions ``start`` onwards:
    ``offset`` (what attention rotates by) is ``start`` + the keys held."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._held = KVCache()  # the keys from ``start``, with mlx-lm's own buffer growth

    @property
    def offset(self) -> int:  # type: ignore[override]  # read-only: KVCache's is an attribute
        return self.start + self._held.offset

    @property
    def keys(self) -> mx.array | None:  # type: ignore[override]  # read-only: KVCache's is an attribute
        return self._held.keys

    @property
    def values(self) -> mx.array | None:  # type: ignore[override]  # read-only: KVCache's is an attribute
        return self._held.values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._held.update_and_fetch(keys, values)

    @property  # type: ignore[misc]  # read-only: KVCache's has a setter
    def state(self) -> tuple[mx.array, mx.array]:
        return self._held.state

    def trim(self, n: int) -> int:
        return self._held.trim(n)

    def size(self) -> int:
        return self.offset

    def held(self) -> KVCache:
        """The keys held, as a cache from position 0 (``RaggedKVCache.add_row`` with ``start`` as
        its shift)."""
        return self._held
