"""The host's own top-level ``/v1/status`` fields with the text path counted in.

vllm-mlx 0.6.0's ``BatchedEngine.get_stats`` promotes its mlx-vlm scheduler's counters to the top level
(``num_requests_processed``, ``total_prompt_tokens``, ``total_completion_tokens``, ``steps_executed``) and its
prefix cache's (``memory_aware_cache``, shown as ``cache``): with the plugin, text requests never reach that
scheduler or cache, so those fields would count media requests only. Here they cover both paths; the ``cache``
block keeps each path's own numbers under ``by_path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The keys the host's /v1/status route reads its `cache` block from, in its order (vllm-mlx 0.6.0 server.status).
HOST_CACHE_KEYS = ("memory_aware_cache", "paged_cache", "prefix_cache")
_SUMMED = ("hits", "misses", "evictions", "tokens_saved", "current_memory_mb", "max_memory_mb", "entry_count", "store_rejections")


@dataclass
class TextTotals:
    """Finished text-path requests and their tokens, counted as the host counts its own."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def finished(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens


def count_text_path(stats: dict[str, Any], totals: TextTotals, steps: int, cache: Any | None) -> None:
    """Add the text path to the host's counters in ``stats`` (its ``get_stats()``), in place."""
    for key, value in (("num_requests_processed", totals.requests), ("total_prompt_tokens", totals.prompt_tokens),
                       ("total_completion_tokens", totals.completion_tokens), ("steps_executed", steps)):
        stats[key] = int(stats.get(key) or 0) + value
    if cache is None:
        return
    key = next((k for k in HOST_CACHE_KEYS if stats.get(k)), HOST_CACHE_KEYS[0])
    stats[key] = both_caches(stats.get(key) or None, text_cache_fields(cache))


def text_cache_fields(cache: Any) -> dict[str, Any]:
    """The text path's prefix cache (``prefix_cache.PrefixCache``) in the host's cache-block shape; counters only,
    cheap enough for ``/health``, which reads ``get_stats`` too."""
    tree = cache.tree
    return {
        "hits": cache.hits,
        "misses": cache.lookups - cache.hits,
        "tokens_saved": cache.hit_tokens,
        "evictions": tree.stats.evictions,
        "current_memory_mb": round(tree.nbytes / 2**20, 2),
        "max_memory_mb": round(tree.budget_bytes / 2**20, 2),
        "entry_count": len(tree),
        "store_rejections": tree.stats.rejected,
        "details": "plugins.mtp-routing.prefix_cache",
    }


def both_caches(host: dict[str, Any] | None, text: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for key in _SUMMED:
        total = (host or {}).get(key, 0) + text[key]
        merged[key] = round(total, 2) if isinstance(total, float) else total
    lookups = merged["hits"] + merged["misses"]
    merged["hit_rate"] = round(merged["hits"] / lookups, 4) if lookups else 0.0
    merged["memory_utilization"] = round(merged["current_memory_mb"] / merged["max_memory_mb"], 4) if merged["max_memory_mb"] else 0.0
    merged["by_path"] = {"mlx_vlm": host, "text": text}
    return merged
