"""What the scheduler hands the runner: typed work for one step, and what the runner hands back.

A step's prefill is planned one item at a time, each after the one before it ran: a prompt's chunk ends are fixed
(the chunk grid, the prefix cache's snapshot positions), but whether the next item fits the step's time budget, and
whether a request's prefix is now in the cache (the one before it may just have prefilled it), are known only then.
The decode is planned once the joins are done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .logprobs import TokenLogprob
from .row import Row
from .state import SparseJobView


def share(tokens: int, first: int, last: int | None, stages: int) -> int:
    """An item's cost in prompt tokens when it runs stages ``first`` up to ``last`` (None: to the end) of ``stages``:
    its share of ``tokens``, at least one."""
    if first == 0 and last is None:
        return tokens
    stop = stages if last is None else last
    return max(1, -(-tokens * (stop - first) // stages))


@dataclass(frozen=True)
class PrefillChunk:
    """A dense forward of ``prompt[start:end]`` of one row, on its own single-sequence caches: its decoder layers
    ``first_layer`` up to ``last_layer`` (None: to the last), the rest in later items (model/layered_forward.py)."""

    row: Row
    start: int
    end: int
    first_layer: int = 0
    last_layer: int | None = None
    layers: int = 1  # the model's decoder layers (only read when the item runs part of them)

    @property
    def positions(self) -> int:
        return self.end - self.start

    @property
    def whole(self) -> bool:
        return self.first_layer == 0 and self.last_layer is None

    @property
    def stop_layer(self) -> int:
        """The layer after its last."""
        return self.layers if self.last_layer is None else self.last_layer

    @property
    def completes(self) -> bool:
        """Does this item end the chunk (its last layer run, ``prefilled`` advanced to ``end``)?"""
        return self.last_layer is None or self.last_layer >= self.layers

    @property
    def tokens(self) -> int:
        """Its cost in prompt tokens: the chunk's, or its layers' share of it."""
        return share(self.positions, self.first_layer, self.last_layer, self.layers)


@dataclass(frozen=True)
class SparsePiece:
    """One piece of a row's SpecPrefill job: a draft scoring chunk, or a chunk of kept tokens on the target."""

    row: Row
    job: SparseJobView
    tokens: int  # its projected cost in prompt tokens
    overlap: bool = False  # no row decodes: launched without waiting for the device


@dataclass(frozen=True)
class MediaEncode:
    """The vision tower over one image of a media row: the embeddings its prompt tokens take (state.MediaInput); its
    blocks ``first_block`` up to ``last_block`` (None: to the last, then its merger), the rest in later items."""

    row: Row
    image: int
    image_tokens: int  # the image's tokens in the prompt
    first_block: int = 0
    last_block: int | None = None
    blocks: int = 1  # the tower's blocks (only read when the item runs part of them)

    @property
    def whole(self) -> bool:
        return self.first_block == 0 and self.last_block is None

    @property
    def stop_block(self) -> int:
        """The block after its last."""
        return self.blocks if self.last_block is None else self.last_block

    @property
    def completes(self) -> bool:
        """Does this item end the image's encode (its features made)?"""
        return self.last_block is None or self.last_block >= self.blocks

    @property
    def tokens(self) -> int:
        """Its projected cost in prompt tokens: the image's, or its blocks' share of them."""
        return share(self.image_tokens, self.first_block, self.last_block, self.blocks)



PrefillWork = PrefillChunk | SparsePiece | MediaEncode


@dataclass(frozen=True)
class PrefillDone:
    """One prefill item as it ran: the tokens it advanced and its seconds, or the error that failed its row."""

    tokens: int
    seconds: float
    error: BaseException | None = None


@dataclass(frozen=True)
class DecodePlan:
    """One decode step of the whole batch: its rows in cache order, and with MTP the draft count and who drafts."""

    rows: Sequence[Row]
    draft_tokens: int = 0
    drafting: list[bool] = field(default_factory=list)


@dataclass
class DecodeResult:
    """Per row, the tokens it emits (plain: one; MTP: its accepted drafts, then one more)."""

    tokens: list[list[int]]
    drafted: list[int] = field(default_factory=list)  # per row; empty: none
    accepted: list[int] = field(default_factory=list)
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)  # per row where asked for; empty: none
    caught_up: bool = False  # the MTP head resumed after plain steps (the step is not timed)
