"""Admission stats as Prometheus metrics, read from `controller.stats()` at scrape time."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .controller import AdmissionController

logger = logging.getLogger(__name__)

PREFIX = "vllm_mlx_mtp_routing_admission_"

# registry -> the one collector registered in it (re-pointed when called again)
_registered: weakref.WeakKeyDictionary[Any, AdmissionCollector] = weakref.WeakKeyDictionary()


class AdmissionCollector:
    def __init__(self, controller: AdmissionController) -> None:
        self.controller = controller

    def describe(self) -> list:
        # Returning nothing makes the registry call collect() for names; collect() is cheap.
        return list(self.collect())

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

        s = self.controller.stats()
        yield CounterMetricFamily(PREFIX + "admitted", "Requests admitted to run.", value=s["admitted"])
        rejected = CounterMetricFamily(PREFIX + "rejected", "Requests refused before starting.", labels=["reason"])
        for reason, n in s["rejected_by_reason"].items():
            rejected.add_metric([reason], n)
        yield rejected
        yield CounterMetricFamily(PREFIX + "enqueued", "Requests that had to wait for room.", value=s["queued_total"])
        yield CounterMetricFamily(PREFIX + "cancelled", "Requests withdrawn while waiting or running.", value=s["cancelled"])
        gauges = {
            "queued": ("Requests waiting for room now.", s["queued"]),
            "running": ("Requests holding a ticket.", s["running"]),
            "reserved_bytes": ("Bytes reserved by running requests' projections.", s["reserved_bytes"]),
            "baseline_bytes": ("Active memory measured while idle (weights, caches).", s["baseline_bytes"]),
            "active_bytes": ("Live mx.get_active_memory().", s["active_bytes"]),
            "budget_bytes": ("Device memory minus headroom.", s["budget_bytes"]),
            "headroom_bytes": ("Memory kept free (--scheduler-headroom-gb).", s["headroom_bytes"]),
            "max_running": ("Most requests running at once.", s["max_running"]),
            "max_queue": ("Most requests waiting at once.", s["max_queue"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        policy = GaugeMetricFamily(PREFIX + "policy_info", "Admission order in use.", labels=["policy"])
        policy.add_metric([s["policy"]], 1)
        yield policy
        wait = Metric(PREFIX + "queue_wait_seconds", "Time from arrival to admission (recent window).", "summary")
        for q in ("50", "95", "99"):
            wait.add_sample(PREFIX + "queue_wait_seconds", {"quantile": f"0.{q}"}, s[f"queue_wait_p{q}_s"])
        wait.add_sample(PREFIX + "queue_wait_seconds_count", {}, s["queue_wait_count"])
        wait.add_sample(PREFIX + "queue_wait_seconds_sum", {}, s["queue_wait_sum_s"])
        yield wait


def host_registry() -> Any | None:
    """The registry vllm-mlx 0.6.0 serves on /metrics, or None while its metrics are disabled.

    Reaches into vllm_mlx.metrics.MetricsCollector._prom (0.6.0): it is created by
    `metrics.configure(enabled=True)`, which `serve_command` calls before loading the model.
    """
    from vllm_mlx.metrics import metrics

    prom = getattr(metrics, "_prom", None)
    if prom is None and metrics.enabled:
        metrics._init_prometheus()
        prom = metrics._prom
    return None if prom is None else prom["registry"]


def register_metrics(controller: AdmissionController, registry: Any | None = None) -> AdmissionCollector | None:
    """Expose `controller` in `registry` (default: the host's /metrics registry).

    Calling again with the same registry re-points the existing collector instead of registering
    a duplicate. Returns None when no registry is given and the host's metrics are disabled.
    """
    if registry is None:
        registry = host_registry()
        if registry is None:
            logger.debug("host metrics disabled (--enable-metrics not given): admission metrics not exposed")
            return None
    collector = _registered.get(registry)
    if collector is not None:
        collector.controller = controller
        return collector
    collector = AdmissionCollector(controller)
    registry.register(collector)
    _registered[registry] = collector
    return collector
