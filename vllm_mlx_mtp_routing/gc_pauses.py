"""The garbage collector's pauses, which land on the step loop.

Text steps run on the event-loop thread, and a full (generation 2) collection walks every container
object the process holds (the host's and every loaded library's among them), a pause that grows with
the process, whichever thread triggers it. Allocation-heavy moments (a long prompt's request, its
token lists, its streams' frames) trigger them, and a stream sees the pause as a gap. Start-up
objects live as long as the server, so after start-up they are frozen out of the collector's scans
(``gc.freeze``, as vLLM does once its engine has started): a full collection then walks only what
was made since. The time spent in collections is counted for the step profile.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

_collecting_since: float | None = None
_collections = 0
_collection_s = 0.0
_frozen = 0  # counted once: gc.get_freeze_count() walks the frozen list (tens of ms for a large heap)


def _on_gc(phase: str, info: dict) -> None:
    global _collecting_since, _collections, _collection_s
    if phase == "start":
        _collecting_since = time.perf_counter()
    elif _collecting_since is not None:
        _collection_s += time.perf_counter() - _collecting_since
        _collections += 1
        _collecting_since = None


def collection_s() -> float:
    """Seconds spent in collections since this module was imported (every thread's)."""
    return _collection_s


def stats() -> dict:
    return {"collections": _collections, "collection_s": round(_collection_s, 4), "frozen_objects": _frozen}


def freeze_startup_heap() -> None:
    """Collect once, then freeze everything alive out of later collections' scans."""
    global _frozen
    tic = time.perf_counter()
    gc.collect()
    full_s = time.perf_counter() - tic
    gc.freeze()
    _frozen = gc.get_freeze_count()
    tic = time.perf_counter()
    gc.collect()
    logger.info(
        "mtp-routing: %d start-up objects frozen out of the garbage collector's scans (a full collection took %.0f ms, now %.1f ms)",
        _frozen, full_s * 1e3, (time.perf_counter() - tic) * 1e3,
    )


if _on_gc not in gc.callbacks:
    gc.callbacks.append(_on_gc)
