"""The orders in which waiting requests are admitted.

The controller admits strictly in policy order: the head of the queue must fit before anyone
behind it is considered, so a large request is never starved by a stream of small ones that keep
slipping past it. There is no aging: under shortest-first or priority a request that keeps losing
its place is bounded by --scheduler-queue-timeout, which answers it 503 + Retry-After instead of
letting it wait forever.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

POLICIES = ("fifo", "shortest-first", "priority")


@dataclass(frozen=True)
class QueuedRequest:
    seq: int  # arrival order, unique
    prompt_tokens: int
    max_tokens: int
    priority: int = 0


SortKey = Callable[[QueuedRequest], tuple]


def _fifo(r: QueuedRequest) -> tuple:
    return (r.seq,)


def _shortest_first(r: QueuedRequest) -> tuple:
    return (r.prompt_tokens + r.max_tokens, r.seq)


def _priority(r: QueuedRequest) -> tuple:
    return (-r.priority, r.seq)


_KEYS: dict[str, SortKey] = {"fifo": _fifo, "shortest-first": _shortest_first, "priority": _priority}


def sort_key(policy: str) -> SortKey:
    """Smaller key is admitted first."""
    try:
        return _KEYS[policy]
    except KeyError:
        raise ValueError(f"unknown scheduler policy {policy!r}; choose from {', '.join(POLICIES)}") from None
