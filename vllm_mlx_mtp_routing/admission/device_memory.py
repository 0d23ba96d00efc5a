"""How much memory the device running MLX has, and how much of it to keep free by default."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import mlx.core as mx

from ..model.kernels.device import on_gpu

logger = logging.getLogger(__name__)

GiB = 1 << 30

# cgroup v2 and v1 limit files; "max" or a huge number means unlimited.
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _physical_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        import psutil

        return int(psutil.virtual_memory().total)


def _cgroup_limit() -> int | None:
    for name in _CGROUP_LIMIT_FILES:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


def device_memory_bytes() -> tuple[int, str]:
    """Memory available to MLX on the default device, and where the number came from.

    Metal: the recommended working set (what macOS lets the GPU keep resident), not the RAM size.
    CUDA: the device's total memory (mlx reports "total_memory" on the cuda backend).
    CPU: physical RAM, or the container's cgroup limit when that is lower.
    """
    info: dict = {}
    try:
        info = dict(mx.device_info())
    except Exception:  # older mlx or no device: fall through to RAM
        logger.debug("mx.device_info() failed", exc_info=True)
    if on_gpu():
        if info.get("max_recommended_working_set_size"):
            return int(info["max_recommended_working_set_size"]), "metal-recommended"
        if info.get("total_memory"):
            return int(info["total_memory"]), "cuda"
        if info.get("memory_size"):
            return int(info["memory_size"]), "gpu-memory-size"
    ram, limit = _physical_ram(), _cgroup_limit()
    if limit is not None and limit < ram:
        return limit, "cgroup-limit"
    return ram, "physical-ram"


def default_headroom_bytes(device_bytes: int, source: str) -> int:
    """Memory to keep free when --scheduler-headroom-gb is not given.

    Metal: 10% (at least 1 GiB) of the recommended working set, which already leaves macOS its share.
    CUDA: 10% (at least 1 GiB) for the CUDA context, cuBLAS workspaces and allocator fragmentation.
    CPU: 15% (at least 2 GiB) of RAM for the OS, the page cache and other processes.
    Never more than half the device, so small devices keep a usable budget.
    """
    if source in ("metal-recommended", "cuda", "gpu-memory-size"):
        headroom = max(GiB, device_bytes // 10)
    else:
        headroom = max(2 * GiB, device_bytes * 15 // 100)
    return min(headroom, device_bytes // 2)
