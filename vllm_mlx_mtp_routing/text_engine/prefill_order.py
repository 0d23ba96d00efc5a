"""Which prefilling rows a step serves first: queue order, except that a short prompt passes a long one under way.

A step's prefill budget goes to the prefilling rows in order, and a row that does not finish keeps the rest waiting.
Behind an agent's 30K-token prompt, a one-line question would wait for all of it (seconds on a GPU, minutes on a CPU)
although its own prefill is one chunk. So, as vLLM's partial prefills let short prompts pass long ones
(``--max-long-partial-prefills``), a row whose whole remaining prompt is short goes ahead of a long head of the queue,
at most ``MAX_PASSING`` a step, and never two steps running while the head waits: a stream of short requests cannot
starve the long one. Outputs do not depend on the order: each row prefills on its own caches, in chunks fixed by its
positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

SHORT_TOKENS = 256  # a prompt this short (left to prefill) may pass ...
LONG_TOKENS = 4 * SHORT_TOKENS  # ... a head of the queue with at least this much left
MAX_PASSING = 2  # short rows that pass the head in one step


class PrefillRow(Protocol):
    @property
    def prefilled(self) -> int: ...

    @property
    def to_prefill(self) -> int: ...


def left(row: PrefillRow) -> int:
    return row.to_prefill - row.prefilled


def passes(row: PrefillRow, plain: bool) -> bool:
    """May ``row`` pass a long head? ``plain``: a dense text prefill (no image to encode, no SpecPrefill job, not one of
    an n > 1 request's rows), whose cost its token count tells."""
    return plain and left(row) <= SHORT_TOKENS


def prefill_order(rows: Sequence[PrefillRow], plain: Sequence[bool], head_waited: bool) -> list[int]:
    """The indexes of ``rows`` (queue order) in the order this step serves them; ``plain`` as in ``passes``;
    ``head_waited``: short rows passed the head in the step before and it made no progress."""
    order = list(range(len(rows)))
    if len(rows) < 2 or left(rows[0]) < LONG_TOKENS:
        return order
    ready = [i for i in order[1:] if left(rows[i]) == 0]  # prefilled, waiting to join: they cost the head nothing
    short = [] if head_waited else [i for i in order[1:] if i not in ready and passes(rows[i], plain[i])][:MAX_PASSING]
    first = ready + short
    return first + [i for i in order if i not in first]
