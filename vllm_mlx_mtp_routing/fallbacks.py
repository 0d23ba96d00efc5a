"""Why requests without media went to the host's mlx-vlm path: counted per reason, logged once each."""

from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger("vllm_mlx_mtp_routing.routing")


class FallbackReasons:
    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def note(self, reason: str) -> None:
        if reason not in self._counts:
            logger.warning(
                "A text request goes to the mlx-vlm path (no MTP, no exact batching; stop strings are applied by "
                "the plugin, per-request seeds cannot be): %s. Counted in /v1/status routing.fallback and "
                "fallback_reasons; logged once per reason", reason,
            )
        self._counts[reason] += 1

    def counts(self) -> dict[str, int]:
        return dict(self._counts)
