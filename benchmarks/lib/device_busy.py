"""The GPU's busy time over a stretch of work, from CUPTI's activity records (NVIDIA's ``cupti-python``).

Every kernel, memcpy and memset the process runs on the device between ``start()`` and ``stop()`` is recorded by
CUPTI with its device-side start and end; the busy time is the length of the union of those intervals (overlapping
work counts once), clipped to the window. Only where MLX runs on CUDA and ``cupti`` imports: elsewhere
``available()`` is False and ``why`` says why (on MLX's CPU backend the device is the CPU: no separate busy time).

``cupti-python`` is not on the GPU machine: stage its wheel (``cupti-python==13.0.1``, matching CUDA 13.0's
``nvidia-cuda-cupti`` that the machine's image has, with ``cuda-bindings`` and ``cuda-pathfinder``) and
``pyelftools`` with ``benchmarks/gpu/stage.sh`` (benchmarks/gpu/loops.sh says how).

Tracing is on for the whole process once constructed (a few microseconds of the driver's per launch; the timed loops
all run under it alike): construct it before any model work.
"""

from __future__ import annotations

import collections
import threading
from typing import Any


class DeviceBusy:
    """``start()`` ... ``stop()`` -> (busy seconds, kernels) of the device in between, and ``kernel_names`` (how many
    of each kernel ran in it: where a step's launches go); one instance per process."""

    def __init__(self, enable: bool = True) -> None:
        self.why: str | None = None
        self._cupti: Any = None
        self._records: list[tuple[int, int, str | None]] = []  # (start ns, end ns, the kernel's name; None: not a kernel)
        self.kernel_names: collections.Counter[str] = collections.Counter()  # of the last window's kernels
        self.kernel_seconds: collections.Counter[str] = collections.Counter()  # their device time, by name
        self._lock = threading.Lock()
        self._t0 = 0
        self._collecting = False
        if not enable:
            self.why = "off (not asked for)"
            return
        from vllm_mlx_mtp_routing.model.kernels.device import kind

        if kind() != "cuda":
            self.why = ("n/a: MLX runs on the CPU (the device is the CPU)" if kind() == "cpu"
                        else "n/a: CUPTI is NVIDIA's (Metal has no such counter here)")
            return
        try:
            from cupti import cupti  # NVIDIA's cupti-python
        except Exception as e:  # noqa: BLE001 - any import failure means no measurement
            self.why = f"n/a: cupti-python not importable ({type(e).__name__}: {e})"[:300]
            return
        self._cupti = cupti
        try:
            cupti.activity_register_callbacks(self._requested, self._completed)
            # On from the start, before MLX builds any CUDA graph: a graph instantiated untraced may never report
            # its kernels. Records outside a window are dropped; quiesce() keeps their delivery out of timed work.
            for kind_ in (cupti.ActivityKind.CONCURRENT_KERNEL, cupti.ActivityKind.MEMCPY, cupti.ActivityKind.MEMSET):
                cupti.activity_enable(kind_)
        except Exception as e:  # noqa: BLE001
            self.why = f"n/a: CUPTI refused its activity tracing ({type(e).__name__}: {e})"[:300]
            self._cupti = None

    def available(self) -> bool:
        return self._cupti is not None

    @staticmethod
    def _requested() -> tuple[int, int]:
        return 64 << 20, 0  # buffer bytes (~300K records: hundreds of steps), records (0: as many as fit)

    def _completed(self, activities: list) -> None:
        if not self._collecting:
            return
        kernel = self._cupti.ActivityKind.CONCURRENT_KERNEL
        got = [(a.start, a.end, str(getattr(a, "name", None) or "?") if a.kind == kernel else None)
               for a in activities if hasattr(a, "start") and hasattr(a, "end")]
        with self._lock:
            self._records.extend(got)

    def quiesce(self) -> None:
        """Deliver (and drop) the records so far, so that no buffer fills during the timed work that follows."""
        if self._cupti is not None:
            try:
                self._cupti.activity_flush_all(1)
            except Exception as e:  # noqa: BLE001 - tracing that fails mid-run ends the measurement, not the run
                self.give_up(e)

    def give_up(self, e: BaseException) -> None:
        self.why = f"n/a: CUPTI failed mid-run ({type(e).__name__}: {e})"[:300]
        self._cupti = None

    def start(self) -> None:
        """Begin a window; the caller has drained the device (``mx.synchronize()``)."""
        if self._cupti is None:
            return
        self.quiesce()
        with self._lock:
            self._records.clear()
        self._collecting = True
        try:
            self._t0 = self._cupti.get_timestamp()
        except Exception as e:  # noqa: BLE001
            self.give_up(e)

    def stop(self) -> tuple[float, int] | None:
        """End the window (the caller has drained the device): busy seconds in it and kernels that ran; None once
        CUPTI has failed (``why`` says how)."""
        if self._cupti is None:
            return None
        try:
            t1 = self._cupti.get_timestamp()
            self._cupti.activity_flush_all(1)
        except Exception as e:  # noqa: BLE001
            self.give_up(e)
            return None
        finally:
            self._collecting = False
        with self._lock:
            records = sorted((max(s, self._t0), min(e, t1), k) for s, e, k in self._records if e > self._t0 and s < t1)
            self._records.clear()
        busy, end = 0, self._t0
        for s, e, _ in records:
            if e > end:
                busy += e - max(s, end)
                end = e
        self.kernel_names = collections.Counter(r[2] for r in records if r[2] is not None)
        self.kernel_seconds = collections.Counter()
        for s, e, k in records:
            if k is not None:
                self.kernel_seconds[k] += (e - s) / 1e9
        return busy / 1e9, sum(self.kernel_names.values())
