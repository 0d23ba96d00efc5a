"""Acceptance of a verified step, per row: greedy rows keep the longest prefix of drafts equal to
the backbone's argmax; sampled rows run speculative sampling (accept a draft d with probability
min(1, p(d)/q(d)), else resample from norm(max(p - q, 0)); the bonus token from p after the last
accepted draft), which keeps the target distribution. Every random number comes from the row's
own ``RowSampler`` key stream."""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from ..sampling import RowSampler
from .processed_acceptance import processed_row


def speculative_row(
    p_logits: mx.array, q: mx.array, drafts: mx.array, accept_key: mx.array, sample_key: mx.array
) -> tuple[mx.array, mx.array]:
    """Lazy speculative sampling of one row with k drafts.

    p_logits [k+1, V]: the target's processed logits at [x, d_1..d_k]; q [k, V]: the draft
    distributions d_j was sampled from; drafts [k]. Returns (accept [k] bool, candidates [k+1]):
    draft j is accepted with prob min(1, p_j(d_j)/q_j(d_j)); candidates[j] is the replacement
    sampled from norm(max(p_j - q_j, 0)) for j < k, and the bonus token from p_k at j = k. The row
    keeps drafts up to the first rejection j and then candidates[j].
    """
    k = drafts.shape[0]
    p = mx.softmax(p_logits, axis=-1)
    idx = drafts[:, None].astype(mx.int32)
    pd = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]
    qd = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    accept = mx.random.uniform(shape=(k,), key=accept_key) * qd < pd
    resid = mx.maximum(p[:k] - q, 0.0)
    # p == q leaves no residual; a rejection then has probability 0, any p-sample is as good.
    resid = mx.where(resid.sum(axis=-1, keepdims=True) > 0, resid, p[:k])
    dists = mx.concatenate([resid, p[k:]], axis=0)
    cands = mx.random.categorical(mx.log(dists), key=sample_key)
    return accept, cands


def accept_rows(
    logits: mx.array,
    drafts: mx.array | None,
    qs: dict[int, mx.array],
    drafting: list[bool],
    samplers: list[RowSampler],
    k: int,
    per_row: bool = True,
) -> tuple[list[list[int]], list[int]]:
    """Tokens each row emits (its accepted drafts, then one more) and its accepted draft count.

    logits [B, k+1, V] of the verify; drafts [B, k] (None when k = 0); qs: per sampled drafting
    row, the distributions its drafts came from. ``per_row=False``: batch-wide all-or-nothing
    (the host's scheme, kept for comparison), every drafting row keeps the shortest accepted run.
    """
    B = len(samplers)
    targets = mx.argmax(logits, axis=-1)  # [B, k+1]
    lazy: dict[int, tuple[mx.array, ...]] = {}
    for i, s in enumerate(samplers):
        if s.greedy or s.logits is not None:  # processed rows are verified position by position below
            continue
        if drafting[i]:
            assert drafts is not None  # k > 0 when a row drafts
            xp = s.process(logits[i])
            lazy[i] = speculative_row(xp, qs[i], drafts[i], s.next_key(), s.next_key())
        else:
            lazy[i] = (s.sample(logits[i, 0]),)
    mx.eval(targets, drafts if drafts is not None else [], list(lazy.values()))
    t = cast("list[list[int]]", targets.tolist())
    d = cast("list[list[int]]", drafts.tolist()) if drafts is not None else [[] for _ in range(B)]
    counts, finals = [], []
    for i, s in enumerate(samplers):
        a = 0
        if s.logits is not None:
            a, final = _processed(logits[i], d[i] if drafting[i] else [], qs.get(i), s, t[i][0])
        elif s.greedy:
            if drafting[i]:
                while a < k and d[i][a] == t[i][a]:
                    a += 1
            final = t[i][a]
        elif drafting[i]:
            acc, cands = (cast("list[int]", v.tolist()) for v in lazy[i])
            while a < k and acc[a]:
                a += 1
            final = cands[a]
        else:
            final = cast(int, lazy[i][0].item())
        counts.append(a)
        finals.append(final)
    clamped = [dr and samplers[i].logits is None for i, dr in enumerate(drafting)]
    if not per_row and any(clamped):
        # An accepted draft is a valid sample at its position, so clamping keeps exactness. Rows with
        # processed logits keep their own run: their processors already saw it.
        a_min = min(c for c, dr in zip(counts, clamped) if dr)
        finals = [d[i][a_min] if clamped[i] and counts[i] > a_min else finals[i] for i in range(B)]
        counts = [min(c, a_min) if clamped[i] else c for i, c in enumerate(counts)]
    tokens = [d[i][:a] + [f] for i, (a, f) in enumerate(zip(counts, finals))]
    return tokens, [a if dr else 0 for a, dr in zip(counts, drafting)]


def _processed(logits: mx.array, drafts: list[int], q: mx.array | None, sampler: RowSampler, fallback: int) -> tuple[int, int]:
    # A processor's fault (e.g. a grammar with no allowed token) is this row's alone: noted, the row is failed.
    try:
        tokens, a = processed_row(logits, drafts, q, sampler)
    except Exception as exc:
        sampler.fault = exc
        return 0, fallback
    return a, tokens[-1]
