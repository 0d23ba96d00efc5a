"""The verify: one backbone forward of [x_i, d_i1..d_ik] for the whole batch, and the rollback of what it rejected.

The gated-delta layers keep their recurrent state after every position (``capture``) and the conv window input, so
a row that keeps a_i drafts takes position a_i's state; attention KV is trimmed per row (``RaggedKVCache``). Rows
that do not draft this step feed their own token as padding, computed, discarded and rolled back like a rejected
draft, so rows with and without drafts share one forward.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...model.backbone import Captured, backbone_forward
from ..batch_cache import BatchCache


def feed(inputs: mx.array, drafts: mx.array | None, drafting: list[bool]) -> mx.array:
    """[B, 1 + k]: each row's next input, then its drafts (its input again where it does not draft)."""
    if drafts is None:
        return inputs
    return mx.concatenate([inputs, mx.where(mx.array(drafting)[:, None], drafts, inputs)], axis=1)


def forward(
    model: nn.Module, tokens: mx.array, cache: BatchCache, *, hidden_state_mode: str, capture: bool,
    launch_every: int = 0,
) -> tuple[mx.array, mx.array, list[Captured]]:
    """(logits [B, T, V], the hidden states the head reads, the captured gated-delta states); ``launch_every``: start
    the layers on the device every that many layers while the rest is built (0: none)."""
    logits, hidden, captured = backbone_forward(model, tokens, cache.layers, hidden_state_mode=hidden_state_mode,
                                                capture=capture, launch_every=launch_every)
    assert logits is not None
    return logits, hidden, captured


def roll_back(cache: BatchCache, captured: list[Captured], tokens: list[list[int]], fed: int) -> None:
    """Row i keeps what produced its len(tokens[i]) tokens: its input and its accepted drafts."""
    cache.rollback(captured, [len(t) for t in tokens], fed)
