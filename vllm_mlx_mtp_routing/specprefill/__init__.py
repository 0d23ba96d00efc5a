"""SpecPrefill on the text path: a small draft model scores the prompt's tokens, the target
prefills only the kept ones at their own positions, decoding continues at the prompt's length.

- ``settings``: the host's flags and the per-request decision; ``scoring``: the draft's attention
  scores and the chunk selection; ``sparse_prefill``: the positioned forward and the
  ``PrefillState`` it fills; ``pipeline``: both in pieces inside the text engine's steps;
  ``metrics``: the counters in ``/v1/status``.
- In a server: ``TextEngine(..., specprefill=SpecPrefill(draft, SpecPrefillSettings(...)))``.
- Alone (benchmarks): ``prefill_sparse`` returns the state a ``BatchScheduler.add(request,
  restored=state)`` decodes from.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from ..text_engine.state import PrefillState
from .pipeline import SparseJob, SpecPrefill
from .scoring import score_tokens
from .settings import RequestChoice, SpecPrefillSettings
from .sparse_prefill import SparsePrefill

__all__ = ["PrefillState", "RequestChoice", "SparseJob", "SpecPrefill", "SpecPrefillSettings", "prefill_sparse", "score_tokens"]


def prefill_sparse(model: nn.Module, draft: nn.Module, prompt_ids: list[int], keep_pct: float, *, backbone_pct: float = 0.0,
                   decode: Any = None, chunk_tokens: int = 2048, settings: SpecPrefillSettings | None = None,
                   state: PrefillState | None = None) -> tuple[PrefillState, list[int]]:
    """Score ``prompt_ids`` with ``draft`` and prefill the kept tokens on ``model`` at once ->
    (the state covering prompt[:-1], the kept positions). ``decode``: the engine's decode strategy
    (an ``MTPDecode`` fills its head's caches too); ``state``: a restored prefix to continue from."""
    state = state or PrefillState()
    kept = score_tokens(draft, prompt_ids, keep_pct, start=state.prefilled, backbone_pct=backbone_pct,
                        settings=settings, chunk_tokens=chunk_tokens)
    head = getattr(decode, "head", None) if getattr(decode, "head_layers", 0) else None
    job = SparsePrefill(model, list(prompt_ids), kept, state, chunk_tokens=chunk_tokens, head=head,
                        hidden_state_mode=getattr(decode, "hidden_state_mode", "post_norm"))
    while not job.done:
        job.advance()
    return state, kept
