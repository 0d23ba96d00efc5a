"""n rows of one request (OpenAI ``n``) prefilled once.

The rows of a request arrive as separate requests carrying the same ``SharedPrefill``. The first
to reach prefill leads: it prefills as any request does. When it joins the decode batch its
prefill-stage state is kept (a prefix-cache ``Snapshot``: copies, never views of the leader's
buffers) and every other row starts from a restore of it, through the insert API built for the
prefix cache (``PrefillState``), with no prompt token prefilled again. A row whose prompt differs
(a template that renders differently on each call) prefills alone; so does every row if the
leader's state cannot be kept. The state is dropped once every row has joined or left, and at
the latest with the ``SharedPrefill`` object itself (the HTTP request that made it); rows that come
after that (the later prompts of a completion of several) prefill alone.
"""

from __future__ import annotations

import logging
from typing import Any

from ..prefix_cache.snapshot import Snapshot, restore, take
from .state import PrefillState, SharingRow

logger = logging.getLogger(__name__)


class SharedPrefill:
    """One request's ``rows`` rows: who leads, and the leader's state once it has joined."""

    def __init__(self, rows: int) -> None:
        if rows < 1:
            raise ValueError("rows must be >= 1")
        self.rows = rows
        self.prompt: tuple[int, ...] | None = None
        self.leader: SharingRow | None = None
        self.snapshot: Snapshot | None = None
        self.unshareable = False  # the leader's state could not be kept: every row prefills alone
        self.done = 0  # rows that joined or left

    def ready(self, row: SharingRow, model: Any, with_head: bool) -> bool:
        """May ``row`` prefill now? A follower takes the leader's state here; False: it waits for the leader."""
        # Past its n rows (a completion of several prompts runs each copy's prompts in turn) the sharing is over.
        if row.prefill is not None or row.to_prefill <= 0 or self.unshareable or self.done >= self.rows:
            return True
        prompt = tuple(row.req.prompt_ids)
        if self.prompt is None:
            self.prompt = prompt
        elif prompt != self.prompt:
            return True
        if self.snapshot is not None:
            row.prefill = restore([self.snapshot], model.make_cache(), with_head)
            row.shared_prefill = True
            return True
        if self.leader is None or self.leader is row:
            self.leader = row
            return True
        return False

    def joined(self, row: SharingRow, state: PrefillState) -> None:
        """``row`` is about to join the batch with ``state`` (before the batch takes it)."""
        if row is self.leader and self.snapshot is None and self.done + 1 < self.rows:
            try:
                self.snapshot = take(state, None)
            except Exception as exc:  # sharing saves work only: the other rows prefill themselves
                logger.warning("n rows: the prefilled state cannot be shared (%s); each row prefills alone", exc)
                self.unshareable = True
        self._count_done()

    def left(self, row: SharingRow) -> None:
        """``row`` left before joining (aborted, or its prefill failed): another row leads."""
        if row is self.leader:
            self.leader = None
        self._count_done()

    def _count_done(self) -> None:
        self.done += 1
        if self.done >= self.rows:
            self.snapshot = None
