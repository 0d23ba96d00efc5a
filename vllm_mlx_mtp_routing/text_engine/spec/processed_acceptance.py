"""Verification of one row whose logits are processed (``RowLogits``): position by position.

Position j's logits are processed with the row's tokens and drafts 0..j-1 (exactly what plain
decoding would pass, had it emitted those drafts), and the walk stops at the first rejected draft
(or where the row finishes): the processors are never called past the accepted run, so nothing of
theirs needs rolling back. A greedy row whose processing is pure (penalties, logit bias) has every
position processed in one evaluation instead, since calls past the run change nothing.
Greedy rows keep a draft while it equals the processed argmax; sampled rows run speculative
sampling against the processed distribution (accept d with prob min(1, p(d)/q(d)), else resample
from norm(max(p - q, 0)); the bonus token from p), two keys of the row's own stream per drafting
step as in ``acceptance.speculative_row``, one per non-drafting step as in plain decoding.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from ..sampling import RowSampler


def processed_row(logits: mx.array, drafts: list[int], q: mx.array | None, sampler: RowSampler) -> tuple[list[int], int]:
    """(tokens the row emits, drafts accepted) from its verify logits [k+1, V] and its k drafts ([] when not drafting)."""
    assert sampler.logits is not None  # a processed row
    k = len(drafts)
    if sampler.greedy:
        if sampler.logits.pure:  # no state to protect: every position at once, one evaluation
            targets = cast("list[int]", mx.argmax(mx.stack([sampler.logits(logits[j], drafts[:j]) for j in range(k + 1)]), axis=-1).tolist())
        tokens: list[int] = []
        for j in range(k + 1):
            t = targets[j] if sampler.logits.pure else cast(int, mx.argmax(sampler.logits(logits[j], drafts[:j])).item())
            tokens.append(t)
            if j == k or t != drafts[j] or sampler.logits.ends(t, j + 1):
                return tokens, j
    if not k:
        return [cast(int, sampler.sample(sampler.logits(logits[0])).item())], 0
    assert q is not None
    uniform = cast("list[float]", mx.random.uniform(shape=(k,), key=sampler.next_key()).tolist())
    keys = mx.random.split(sampler.next_key(), k + 1)
    for j in range(k + 1):
        xp = sampler.process(sampler.logits(logits[j], drafts[:j]))
        if j == k:
            return drafts + [cast(int, mx.random.categorical(xp, key=keys[j]).item())], k
        p = mx.softmax(xp, axis=-1)
        d = drafts[j]
        pd, qd = cast(float, p[d].item()), cast(float, q[j, d].item())
        if uniform[j] * qd < pd:
            if sampler.logits.ends(d, j + 1):
                return drafts[: j + 1], j
            continue
        resid = mx.maximum(p - q[j], 0.0)
        resid = mx.where(resid.sum() > 0, resid, p)  # p == q leaves no residual: any p-sample will do
        return drafts[:j] + [cast(int, mx.random.categorical(mx.log(resid), key=keys[j]).item())], j
    raise AssertionError("unreachable")
