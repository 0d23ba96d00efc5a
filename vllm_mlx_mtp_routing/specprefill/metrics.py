"""SpecPrefill's counters, shown under ``plugins.mtp-routing.specprefill`` in ``/v1/status``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecPrefillMetrics:
    requests: int = 0  # requests prefilled sparsely
    tokens_scored: int = 0  # prompt tokens the draft scored (after any prefix-cache hit)
    tokens_kept: int = 0  # of those, prefilled by the target
    draft_tokens: int = 0  # tokens the draft ran (its prefill of the whole prompt and the look-ahead)
    scoring_s: float = 0.0
    sparse_prefill_s: float = 0.0
    fallbacks: int = 0  # scoring errors: the request was prefilled densely
    dense: dict[str, int] = field(default_factory=dict)  # requests left dense, by reason

    def skipped(self, reason: str) -> None:
        self.dense[reason] = self.dense.get(reason, 0) + 1

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "requests": self.requests,
            "tokens_scored": self.tokens_scored,
            "tokens_kept": self.tokens_kept,
            "keep_ratio": round(self.tokens_kept / self.tokens_scored, 4) if self.tokens_scored else None,
            "draft_tokens": self.draft_tokens,
            "scoring_s": round(self.scoring_s, 3),
            "sparse_prefill_s": round(self.sparse_prefill_s, 3),
            "fallbacks": self.fallbacks,
            "dense": dict(sorted(self.dense.items())),
        }
