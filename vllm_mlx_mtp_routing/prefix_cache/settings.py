"""The host's prefix-cache flags, read with the host's meaning for the text path.

``--enable-prefix-cache`` (default on) / ``--disable-prefix-cache``; the byte budget is
``--cache-memory-mb`` or else ``--cache-memory-percent`` of the available RAM, computed by the host's
own ``MemoryCacheConfig`` (so both paths read the flags alike). ``--warm-prompts`` needs nothing
here: the host's start-up warm-up sends each prompt's system prefix through the engine, the text
path serves it, and the snapshots it leaves stay (kept as long as system prefixes).
``--ssd-cache-dir`` / ``--ssd-cache-max-gb`` (GB of 10^9 bytes, the host's default 10) give the cache
its second tier on disk (``disk_tier.py``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plugin_api.errors import FlagError


@dataclass
class PrefixCacheSettings:
    enabled: bool = True
    budget_bytes: int = 0
    ssd_dir: str | None = None  # --ssd-cache-dir: the second tier (None: memory only)
    ssd_budget_bytes: int = 0  # --ssd-cache-max-gb


def from_args(args: Any) -> PrefixCacheSettings:
    """Raise FlagError naming a bad flag; ``args`` may be None (engines built without a CLI)."""
    enabled = bool(getattr(args, "enable_prefix_cache", True)) and not getattr(args, "disable_prefix_cache", False)
    mb = getattr(args, "cache_memory_mb", None)
    percent = getattr(args, "cache_memory_percent", 0.20)
    if mb is not None and (not isinstance(mb, int) or mb < 0):
        raise FlagError("--cache-memory-mb", f"must be an integer >= 0, got {mb}")
    if percent is None or not (isinstance(percent, (int, float)) and math.isfinite(percent) and 0.0 < percent <= 1.0):
        raise FlagError("--cache-memory-percent", f"must be in (0, 1], got {percent}")
    ssd_dir = getattr(args, "ssd_cache_dir", None) or None
    ssd_gb = getattr(args, "ssd_cache_max_gb", 10.0)
    if ssd_dir is not None:
        if not (isinstance(ssd_gb, (int, float)) and math.isfinite(ssd_gb) and ssd_gb > 0):
            raise FlagError("--ssd-cache-max-gb", f"must be a number of GB > 0, got {ssd_gb}")
        try:
            Path(ssd_dir).mkdir(parents=True, exist_ok=True)
            if not os.access(ssd_dir, os.W_OK):
                raise PermissionError("not writable")
        except OSError as e:
            raise FlagError("--ssd-cache-dir", f"cannot use {ssd_dir!r} as a cache directory: {e}") from e
    if not enabled:
        return PrefixCacheSettings(False, 0)
    from ..host.engine_access import host_cache_budget_bytes

    return PrefixCacheSettings(True, host_cache_budget_bytes(mb, float(percent)), ssd_dir,
                               int(float(ssd_gb) * 1e9) if ssd_dir else 0)
