"""A row's MTP state (``Row.decode`` under ``MTPDecode``): its history, the (hidden, token)
pairs verified since the head last ran, and its recent acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class MTPRowState:
    history: list[int]  # prompt + generated tokens (the last is the row's next input)
    prompt_len: int
    # Pairs verified since the head's last sync: hidden[row, start:stop] of a step's [B', T, H]
    # hidden state, with the tokens that follow them.
    pending_h: list[tuple[mx.array, int, int, int]] = field(default_factory=list)
    pending_t: list[int] = field(default_factory=list)
    skipped: int = 0  # older pairs dropped unsynced: the head skips their positions
    # The draft policy's estimate, per draft position j: the recent chance that draft j is accepted when every draft
    # before it was (None: not drafted yet).
    position_acceptance: list[float] | None = None

    @property
    def acceptance(self) -> float | None:
        """Recent accepted drafts per drafting step, at the positions estimated."""
        p = self.position_acceptance
        return None if p is None else expected_accepted(p, len(p))

    def add_pending(self, hidden: mx.array, i: int, tokens: list[int]) -> None:
        self.pending_h.append((hidden, i, 0, len(tokens)))
        self.pending_t.extend(tokens)

    def keep_last(self, window: int) -> None:
        """Keep at most ``window`` pending pairs, dropping the oldest."""
        drop = len(self.pending_t) - window
        if drop <= 0:
            return
        self.skipped += drop
        self.pending_t = self.pending_t[drop:]
        while drop:
            h, i, a, b = self.pending_h[0]
            n = min(drop, b - a)
            if n == b - a:
                self.pending_h.pop(0)
            else:
                self.pending_h[0] = (h, i, a + n, b)
            drop -= n


def expected_accepted(positions: list[float], k: int) -> float:
    """Accepted drafts per step drafting k, given each position's conditional acceptance: a draft counts only when
    every draft before it was accepted."""
    total, reach = 0.0, 1.0
    for p in positions[:k]:
        reach *= p
        total += reach
    return total
