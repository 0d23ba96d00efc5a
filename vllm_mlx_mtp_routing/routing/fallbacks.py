"""Why requests without media went to the host's mlx-vlm path, and what that path could not honour:
counted per reason, logged once each."""

from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger("vllm_mlx_mtp_routing.routing")


class FallbackReasons:
    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._ignored: Counter[str] = Counter()

    def note(self, reason: str) -> None:
        if reason not in self._counts:
            logger.warning(
                "A request goes to the host's mlx-vlm path (no MTP, no exact batching; stop strings are applied by "
                "the plugin, per-request seeds cannot be): %s. Counted in /v1/status routing.fallback and "
                "fallback_reasons; logged once per reason", reason,
            )
        self._counts[reason] += 1

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def ignored(self, option: str) -> None:
        """A request on the mlx-vlm path asked for ``option``, which that path cannot honour."""
        if option not in self._ignored:
            logger.warning(
                "A request on the mlx-vlm path (media or fallback) sets %s, which that path cannot honour (its batch "
                "samples from one random stream); counted in /v1/status host_path_ignored; logged once", option,
            )
        self._ignored[option] += 1

    def ignored_counts(self) -> dict[str, int]:
        return dict(self._ignored)
