"""Log-probabilities of emitted tokens, from the model's own logits (before any processing,
temperature or filtering: what vLLM reports by default and what a direct forward pass gives)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .sampling import RowSampler


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the most likely tokens, best first


def position_logprobs(logits: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
    """One entry per emitted token; ``logits`` [T, V] holds (at least) one row per token, in order."""
    x = logits[: len(tokens)].astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(tokens, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    if top:
        best = mx.argsort(-lp, axis=-1)[:, :top]
        best_lp = mx.take_along_axis(lp, best, axis=-1)
        mx.eval(chosen, best, best_lp)
        pairs = [list(zip(b, v)) for b, v in zip(best.tolist(), best_lp.tolist())]
    else:
        mx.eval(chosen)
        pairs = [[] for _ in tokens]
    return [TokenLogprob(t, v, p) for t, v, p in zip(tokens, chosen.tolist(), pairs)]


def row_logprobs(
    logits: mx.array, tokens: list[list[int]], samplers: list[RowSampler]
) -> list[list[TokenLogprob] | None]:
    """Per row of ``logits`` [B, T, V]: its emitted tokens' entries, None where not asked for ([] if no row asks)."""
    if not any(s.options.logprobs for s in samplers):
        return []
    return [
        position_logprobs(logits[i], toks, s.options.top_logprobs) if s.options.logprobs else None
        for i, (toks, s) in enumerate(zip(tokens, samplers))
    ]
