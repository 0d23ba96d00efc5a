"""MTP decoding with acceptance as a controlled input, for benchmarks at realistic shapes.

A model with random weights has a head that drafts nothing the backbone agrees with, and its
near-tie logits round differently in a [B, 2] verify and a [B, 1] step (bf16 on CUDA), so an
oracle that proposes a precomputed "true" continuation stops matching after a few tokens. Here the
verify itself is told: before acceptance, the verify's logit of each draft is raised far above
every other (accepted, with probability ``acceptance`` per draft) or pushed below them (rejected).
Everything else is the engine's own code path: the head drafts, the backbone verifies [x, drafts],
``accept_rows`` accepts per row (or batch-wide), the caches roll back per row.

The forcing is a few elementwise ops on the verify's logits per step and a [B, k] array from the host;
the decisions come from a seeded ``random.Random``. Greedy rows only (the benchmarks'); a sampled
row's speculative sampling would see the forced logits as its target distribution.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx

from vllm_mlx_mtp_routing.model.mtp import MTPHead
from vllm_mlx_mtp_routing.text_engine.sampling import RowSampler
from vllm_mlx_mtp_routing.text_engine.spec.acceptance import accept_rows
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode

FORCE = 1e4  # far above any logit of a model with normalized hidden states, and exact in bf16


class ForcedAcceptance:
    """An acceptance rule (``MTPDecode(acceptance=...)``) whose verify agrees with each draft with probability
    ``acceptance``, then accepts as ``accept_rows`` does."""

    def __init__(self, acceptance: float, *, seed: int = 0, per_row: bool = True) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.acceptance = acceptance
        self.seed = seed
        self.per_row = per_row
        self._rng = random.Random(seed)

    def fresh(self) -> ForcedAcceptance:
        """The same rule with its own decisions from the start (the warm-up's do not use up this one's)."""
        return ForcedAcceptance(self.acceptance, seed=self.seed, per_row=self.per_row)

    def __call__(
        self, logits: mx.array, drafts: mx.array | None, qs: dict[int, mx.array], drafting: list[bool],
        samplers: list[RowSampler], k: int,
    ) -> tuple[list[list[int]], list[int]]:
        if drafts is not None and any(drafting):
            logits = self._force(logits, drafts, drafting, k)
        return accept_rows(logits, drafts, qs, drafting, samplers, k, self.per_row)

    def _force(self, logits: mx.array, drafts: mx.array, drafting: list[bool], k: int) -> mx.array:
        a, rng = self.acceptance, self._rng
        delta = [[(FORCE if rng.random() < a else -FORCE) if d else 0.0 for _ in range(k)] for d in drafting]
        V = logits.shape[-1]
        # Position j's logits judge drafts[:, j] (fed at position j + 1): raise or sink that entry.
        # Elementwise (a compare against the vocabulary), no scatter: every backend runs it.
        hit = mx.arange(V, dtype=mx.uint32)[None, None, :] == drafts[:, :, None]
        forced = logits[:, :k] + hit.astype(logits.dtype) * mx.array(delta, dtype=logits.dtype)[:, :, None]
        return mx.concatenate([forced, logits[:, k:]], axis=1)


class ForcedAcceptanceDecode(MTPDecode):
    """``MTPDecode`` whose verify agrees with each draft with probability ``acceptance``.

    With k > 1 draft j is decided on its own, so a row accepts j drafts with probability
    a^j (1 - a) (all k: a^k), as with a drafter of constant per-token acceptance a.
    """

    def __init__(self, head: MTPHead, acceptance: float, *, seed: int = 0, **options: Any) -> None:
        self.forced = ForcedAcceptance(acceptance, seed=seed, per_row=options.get("per_row_acceptance", True))
        super().__init__(head, acceptance=self.forced, **options)

    @property
    def acceptance(self) -> float:
        return self.forced.acceptance

    def twin(self, policy: Any) -> ForcedAcceptanceDecode:
        twin = super().twin(policy)
        assert isinstance(twin, ForcedAcceptanceDecode)
        twin.forced = self.forced.fresh()
        twin.accept = twin.forced
        return twin
