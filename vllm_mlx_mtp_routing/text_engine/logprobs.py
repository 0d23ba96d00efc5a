"""Log-probabilities of emitted tokens, from the model's own logits (before any processing,
temperature or filtering: what vLLM reports by default and what a direct forward pass gives)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx

from .sampling import RowSampler


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the most likely tokens, best first


def _lazy(logits: mx.array, tokens: list[int], top: int) -> tuple[mx.array, ...]:
    x = logits[: len(tokens)].astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(tokens, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    if not top:
        return (chosen,)
    best = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
    best_lp = mx.take_along_axis(lp, best, axis=-1)
    order = mx.argsort(-best_lp, axis=-1)
    return chosen, mx.take_along_axis(best, order, axis=-1), mx.take_along_axis(best_lp, order, axis=-1)


def _entries(tokens: list[int], arrays: tuple[mx.array, ...]) -> list[TokenLogprob]:
    chosen = cast("list[float]", arrays[0].tolist())
    if len(arrays) > 1:
        ids, lps = cast("list[list[int]]", arrays[1].tolist()), cast("list[list[float]]", arrays[2].tolist())
        pairs = [list(zip(b, v)) for b, v in zip(ids, lps)]
    else:
        pairs = [[] for _ in tokens]
    return [TokenLogprob(t, v, p) for t, v, p in zip(tokens, chosen, pairs)]


def position_logprobs(logits: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
    """One entry per emitted token; ``logits`` [T, V] holds (at least) one row per token, in order."""
    arrays = _lazy(logits, tokens, top)
    mx.eval(arrays)
    return _entries(tokens, arrays)


def row_logprobs(
    logits: mx.array, tokens: list[list[int]], samplers: list[RowSampler]
) -> list[list[TokenLogprob] | None]:
    """Per row of ``logits`` [B, T, V]: its emitted tokens' entries, None where not asked for ([] if no row asks)."""
    if not any(s.options.logprobs for s in samplers):
        return []
    lazy = {i: _lazy(logits[i], toks, s.options.top_logprobs) for i, (toks, s) in enumerate(zip(tokens, samplers)) if s.options.logprobs}
    mx.eval(list(lazy.values()))  # one evaluation for every row that asks
    return [_entries(tokens[i], lazy[i]) if i in lazy else None for i in range(len(samplers))]
