"""The prefix cache's counters as Prometheus metrics on the host's /metrics (with --enable-metrics),
read from ``PrefixCache.stats()`` at scrape time, prefixed ``vllm_mlx_mtp_routing_prefix_cache_``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "vllm_mlx_mtp_routing_prefix_cache_"
_COUNTERS = {
    "lookups": "Prefix-cache lookups (one per text request with a prompt to prefill).",
    "hits": "Lookups that restored a cached prefix.",
    "hit_tokens": "Prompt tokens restored instead of prefilled.",
    "prefilled_tokens": "Prompt tokens prefilled by requests that looked the cache up.",
    "evictions": "Snapshots evicted to stay within the byte budget.",
    "snapshots_saved": "Snapshots stored.",
    "disk_hits": "Lookups that restored a prefix from the disk tier (--ssd-cache-dir).",
}
_GAUGES = {
    "entries": "Snapshots held.",
    "bytes": "Bytes held by snapshots.",
    "budget_bytes": "Byte budget (--cache-memory-mb / --cache-memory-percent).",
    "token_hit_rate": "hit_tokens / (hit_tokens + prefilled_tokens).",
}


class PrefixCacheCollector:
    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def describe(self) -> list:
        return list(self.collect())

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.cache.stats()
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=s[name])
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=s[name])
        disk = s.get("disk", {})
        if disk.get("enabled"):
            yield GaugeMetricFamily(PREFIX + "disk_bytes", "Bytes of snapshot files on disk.", value=disk["bytes"])
            yield GaugeMetricFamily(PREFIX + "disk_entries", "Snapshot files on disk.", value=disk["entries"])


def register_metrics(cache: Any) -> PrefixCacheCollector | None:
    from ..admission.metrics import host_registry

    registry = host_registry()
    if registry is None:
        logger.debug("host metrics disabled (--enable-metrics not given): prefix-cache metrics not exposed")
        return None
    collector = PrefixCacheCollector(cache)
    registry.register(collector)
    return collector
