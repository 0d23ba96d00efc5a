"""Per-row faults kept out of the shared step.

A request's sampling options are exercised once, alone, before it may join a batch (``preflight``): a
value the sampler cannot use fails that request with a clear message instead of failing the decode
step that every running row shares. A fault that still happens inside a step is pinned on its row
(``RowSampler.fault``, set by ``sample_rows``; ``error_output`` for a row whose stop handling raised):
that row finishes with an error, the rest of the batch continues.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from .sampling import RowSampler, SamplingOptions
from .state import TextOutput

logger = logging.getLogger(__name__)


class RowOptionsError(ValueError):
    """The request's own options cannot be sampled with."""


def preflight(options: SamplingOptions) -> None:
    """Raise RowOptionsError if sampling with ``options`` fails on a tiny dummy row."""
    try:
        probe = RowSampler(options)
        if not probe.greedy:
            mx.eval(probe.sample(mx.zeros((8,), dtype=mx.float32)))
    except Exception as exc:
        raise RowOptionsError(f"sampling options cannot be used: {type(exc).__name__}: {exc}") from exc


def error_output(seq: object, exc: BaseException) -> TextOutput:
    """A failed row's final output, built without its detokenizer (which may be what failed)."""
    logger.error("request %s failed alone: %s: %s", getattr(seq, "rid", "?"), type(exc).__name__, exc)
    tokens = list(getattr(seq, "token_ids", []))
    prompt = getattr(getattr(seq, "req", None), "prompt_ids", [])
    return TextOutput(
        request_id=getattr(seq, "rid", "?"), new_text="", text=getattr(seq, "emitted_text", ""), new_token_ids=[],
        token_ids=tokens, prompt_tokens=len(prompt), completion_tokens=len(tokens), finished=True,
        finish_reason="error", error=f"{type(exc).__name__}: {exc}",
    )
