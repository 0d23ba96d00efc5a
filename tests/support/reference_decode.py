"""Single-sequence (batch 1) greedy decoders: the references the batched engine is tested
against. Not used by the server.

``mtp_greedy_generate`` drafts k tokens with a drafter, verifies [token, drafts] in one backbone
forward that captures the gated-delta states (``backbone.backbone_forward(capture=True)``), accepts
the longest matching prefix plus the backbone's own next token and rolls the cache back to it.
Its output equals ``greedy_generate`` (mlx-lm's own forward, one token per step) token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from vllm_mlx_mtp_routing.model.backbone import backbone_forward, rollback_rows
from vllm_mlx_mtp_routing.model.mlx_lm_internals import TextModel


class Drafter(Protocol):
    def make_cache(self) -> list[Any]: ...

    def draft(self, hidden: mx.array, tokens: mx.array, cache: Sequence[Any], k: int = 1) -> mx.array: ...


@dataclass
class DecodeResult:
    tokens: list[int]
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def _finish(out: list[int], new: Sequence[int], max_tokens: int, eos: set[int]) -> bool:
    """Append new tokens up to max_tokens or the first EOS; True when generation is over."""
    for t in new:
        out.append(t)
        if len(out) >= max_tokens or t in eos:
            return True
    return False


def greedy_generate(
    text_model: TextModel,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
) -> DecodeResult:
    """Plain greedy decoding, one token per forward: the baseline MTP decoding must equal."""
    cache = text_model.make_cache()
    eos = set(eos_token_ids)
    logits = text_model(mx.array([list(prompt)]), cache=cache)
    out: list[int] = []
    while True:
        tok = int(mx.argmax(logits[0, -1]).item())
        if _finish(out, [tok], max_tokens, eos):
            return DecodeResult(out)
        logits = text_model(mx.array([[tok]]), cache=cache)


def mtp_greedy_generate(
    text_model: TextModel,
    drafter: Drafter,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    k: int = 1,
    eos_token_ids: Sequence[int] = (),
    hidden_state_mode: str = "post_norm",
) -> DecodeResult:
    """Greedy decoding with MTP speculation, batch 1: draft k tokens, verify [token, drafts] in
    one backbone forward, accept the longest matching prefix plus the backbone's own next token.

    On rejection the backbone cache keeps the first a+1 verified positions: KV caches are trimmed
    and each gated-delta layer takes its captured state after that position, so nothing is
    recomputed. The head's cache never holds unverified entries (see MTPHead.draft).
    The output equals `greedy_generate` token for token (up to floating-point ties).
    """
    if max_tokens <= 0:
        return DecodeResult([])
    cache = text_model.make_cache()
    mtp_cache = drafter.make_cache()
    eos = set(eos_token_ids)
    prompt = list(prompt)

    logits, hidden, _ = backbone_forward(text_model, mx.array([prompt]), cache, hidden_state_mode=hidden_state_mode)
    x = int(mx.argmax(logits[0, -1]).item())
    result = DecodeResult([])
    if _finish(result.tokens, [x], max_tokens, eos):
        return result
    pair_hidden, pair_tokens = hidden, prompt[1:] + [x]

    while True:
        drafts = drafter.draft(pair_hidden, mx.array([pair_tokens]), mtp_cache, k)[0].tolist()
        logits, hidden, captured = backbone_forward(
            text_model, mx.array([[x] + drafts]), cache, hidden_state_mode=hidden_state_mode, capture=True
        )
        target = mx.argmax(logits[0], axis=-1).tolist()
        a = 0
        while a < k and drafts[a] == target[a]:
            a += 1
        rollback_rows(cache, captured, [a + 1], k + 1)
        new = target[: a + 1]
        result.drafted += k
        result.accepted += a
        result.verify_steps += 1
        result.accepted_per_step.append(a)
        if _finish(result.tokens, new, max_tokens, eos):
            return result
        pair_hidden, pair_tokens = hidden[:, : a + 1], new
        x = new[-1]
