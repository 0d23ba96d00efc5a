"""Decode strategies: how the running batch advances by one scheduler step.

This is the plug-in point for batched speculative (MTP) decoding. The scheduler owns request
bookkeeping (stops, max_tokens, streaming, joins and leaves); a strategy owns the forward pass(es),
sampling and any per-row cache rollback. The contract of ``step``:

- on entry, row i's cache holds its prompt and all tokens but ``inputs[i]``, the token it feeds next;
- it returns, per row, one or more new tokens (plain decoding: exactly one; MTP: the accepted drafts
  then the bonus token), each sampled with ``samplers[i]`` (one key split per sampled position keeps
  seeded rows reproducible in any batch);
- on exit, row i's cache holds everything up to but excluding the last returned token, which the
  scheduler feeds as the next ``inputs[i]``. A strategy that verified more than it accepted rolls
  the row back itself: ``RaggedKVCache.trim_rows`` for attention layers (O(1), per row), and the
  gated-delta rows of ``BatchCache.layers`` (``ArraysCache``: cache[0] conv, cache[1] recurrent state,
  batch on axis 0) restored from per-position states it captured.

The scheduler may drop tokens after a stop inside the returned run; such a row leaves the batch.
``prefill`` runs each prefill chunk on the request's ``PrefillState`` (an MTP strategy asks the
model for hidden states there and fills the head's cache for the row); ``join`` returns the
strategy's per-row state, which the row (``Row.decode``) owns from then on. The strategy keeps no
per-row list of its own: ``bind`` hands it the ``DecodeBatch``, whose rows and caches (backbone
and, with ``head_layers`` > 0, the head's ``RaggedKVCache`` per layer) join and leave together. A
row that has no drafts yet (its first decode step) can be padded with dummy drafts and rolled back,
since a forward feeds the same number of tokens to every row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from .batch_cache import BatchCache
from .logprobs import TokenLogprob, row_logprobs
from .rows import DecodeBatch, PrefillState
from .sampling import RowSampler, sample_rows


@dataclass
class DecodeResult:
    tokens: list[list[int]]
    drafted: list[int] = field(default_factory=list)  # per row; empty means none
    accepted: list[int] = field(default_factory=list)
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)  # per row, where asked for; empty: none


class DecodeStrategy(Protocol):
    head_layers: int  # attention caches per row beside the backbone's (an MTP head's layers)

    def bind(self, batch: DecodeBatch) -> None:
        """The batch whose rows this strategy steps (called once by the scheduler)."""

    def prefill(self, model: nn.Module, tokens: mx.array, state: PrefillState) -> None:
        """Run one prefill chunk ([1, n]) of a request on its own single-sequence caches
        (``state.backbone``; an MTP strategy also fills ``state.head`` and ``state.head_hidden``).
        The scheduler advances ``state.prefilled``."""

    def join(self, state: PrefillState, prompt_ids: list[int]) -> Any:
        """A prefilled request is about to become the last row of the batch: its per-row state."""

    def step(
        self, model: nn.Module, cache: BatchCache, inputs: list[int], samplers: list[RowSampler]
    ) -> DecodeResult: ...


class SingleTokenDecode:
    """One forward of [B, 1] and one sampled token per row."""

    head_layers = 0

    def bind(self, batch: DecodeBatch) -> None:
        pass

    def prefill(self, model: nn.Module, tokens: mx.array, state: PrefillState) -> None:
        model(tokens, cache=state.backbone)
        mx.eval([c.state for c in state.backbone])

    def join(self, state: PrefillState, prompt_ids: list[int]) -> None:
        return None

    def step(
        self, model: nn.Module, cache: BatchCache, inputs: list[int], samplers: list[RowSampler]
    ) -> DecodeResult:
        logits = model(mx.array(inputs, dtype=mx.uint32)[:, None], cache=cache.layers)[:, -1, :]
        tokens = sample_rows(logits, samplers)
        mx.eval(tokens, cache.state())
        rows = [[t] for t in tokens.tolist()]
        return DecodeResult(rows, logprobs=row_logprobs(logits[:, None], rows, samplers))
