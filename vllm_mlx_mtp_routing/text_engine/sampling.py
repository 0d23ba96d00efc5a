"""Per-request sampling that gives a row the same tokens alone or inside any batch.

Every row samples from its own logits with its own PRNG key (split once per sampled token), so
neither the batch size nor a row's position in the batch changes which random numbers it sees.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

MAX_TOP_LOGPROBS = 20  # as OpenAI


class LogitsSteering(Protocol):
    """A row's own logits processing before sampling (``logits_processing.RowLogits``)."""

    @property
    def pure(self) -> bool: ...

    def ends(self, token: int, emitted: int) -> bool: ...

    def __call__(self, logits: mx.array, drafts: Sequence[int] = ()) -> mx.array: ...


@dataclass
class SamplingOptions:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # The host's logits processors for this row (JSON mode/schema, logit_bias, thinking budget), called
    # as the host's batched path calls them: ``proc(generated_ids, logits[1, V]) -> logits``. Stateful,
    # hence row-owned: ``logits_processing.fork_options`` gives another row its own copies.
    logits_processors: list[Callable[[Any, Any], Any]] = field(default_factory=list)
    presence_penalty: float = 0.0  # OpenAI: once per token present among the generated tokens
    frequency_penalty: float = 0.0  # OpenAI: per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM: prompt and generated tokens, sign-aware multiplicative
    logprobs: bool = False  # report each generated token's log-probability (the model's own logits)
    top_logprobs: int = 0  # and this many most likely alternatives per position

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        self.logits_processors = list(self.logits_processors or ())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RowSampler:
    """One request's sampling parameters and PRNG stream."""

    def __init__(self, options: SamplingOptions) -> None:
        self.options = options
        self.greedy = options.greedy
        self._seed = options.seed if options.seed is not None else random.getrandbits(63)
        self._key: mx.array | None = None  # built at first use, on the thread that steps
        self.fault: BaseException | None = None  # a sampling fault of this row alone (see row_check)
        self.logits: LogitsSteering | None = None  # the row's logits_processing.RowLogits, None when its logits go in untouched

    def next_key(self) -> mx.array:
        if self._key is None:
            self._key = mx.random.key(self._seed)
        self._key, sub = mx.random.split(self._key)
        return sub

    def process(self, logits: mx.array) -> mx.array:
        """Logits over the last axis after temperature, top-k, top-p and min-p (filtered: -inf).

        The distribution ``sample`` draws from; speculative decoding compares drafts against it.
        """
        o = self.options
        x = logits.astype(mx.float32) * (1.0 / o.temperature)
        neg_inf = mx.array(-float("inf"), dtype=mx.float32)
        if 0 < o.top_k < x.shape[-1]:
            kth = mx.sort(x, axis=-1)[..., -o.top_k : -o.top_k + 1 or None]
            x = mx.where(x >= kth, x, neg_inf)
        if o.top_p < 1.0:
            order = mx.argsort(-x, axis=-1)
            p_sorted = mx.softmax(mx.take_along_axis(x, order, axis=-1), axis=-1)
            # A token stays if the mass strictly before it is below top_p (the top one always stays).
            keep_sorted = (mx.cumsum(p_sorted, axis=-1) - p_sorted) < o.top_p
            keep = mx.take_along_axis(keep_sorted, mx.argsort(order, axis=-1), axis=-1)
            x = mx.where(keep, x, neg_inf)
        if o.min_p > 0.0:
            probs = mx.softmax(x, axis=-1)
            x = mx.where(probs >= o.min_p * probs.max(axis=-1, keepdims=True), x, neg_inf)
        return x

    def sample(self, logits: mx.array) -> mx.array:
        """Sample one token id from a 1-D row of logits (not for greedy rows)."""
        return mx.random.categorical(self.process(logits), key=self.next_key())


def sample_rows(logits: mx.array, samplers: list[RowSampler]) -> mx.array:
    """Next token per row of ``logits`` [B, V]: argmax for greedy rows, own-key sampling otherwise,
    each after the row's own logits processing where it has some."""
    greedy = mx.argmax(logits, axis=-1)
    if all(s.greedy and s.logits is None for s in samplers):
        return greedy
    rows = [
        greedy[i] if s.greedy and s.logits is None else _sample_or_fault(s, logits[i], greedy[i])
        for i, s in enumerate(samplers)
    ]
    return mx.stack(rows).astype(greedy.dtype)


def _sample_or_fault(sampler: RowSampler, logits: mx.array, fallback: mx.array) -> mx.array:
    # A row's own fault must not fail the step the batch shares: note it, let the row be failed alone.
    try:
        if sampler.logits is not None:
            logits = sampler.logits(logits)
            if sampler.greedy:
                return mx.argmax(logits, axis=-1)
        return sampler.sample(logits)
    except Exception as exc:
        sampler.fault = exc
        return fallback
