"""The host's prefix-cache flags, read with the host's meaning for the text path.

``--enable-prefix-cache`` (default on) / ``--disable-prefix-cache``; the byte budget is
``--cache-memory-mb`` or else ``--cache-memory-percent`` of the available RAM, computed by the host's
own ``MemoryCacheConfig`` (so both paths read the flags alike). ``--warm-prompts`` needs nothing
here: the host's start-up warm-up sends each prompt's system prefix through the engine, the text
path serves it, and the snapshots it leaves stay (kept as long as system prefixes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import FlagError


@dataclass
class PrefixCacheSettings:
    enabled: bool = True
    budget_bytes: int = 0


def from_args(args: Any) -> PrefixCacheSettings:
    """Raise FlagError naming a bad flag; ``args`` may be None (engines built without a CLI)."""
    enabled = bool(getattr(args, "enable_prefix_cache", True)) and not getattr(args, "disable_prefix_cache", False)
    mb = getattr(args, "cache_memory_mb", None)
    percent = getattr(args, "cache_memory_percent", 0.20)
    if mb is not None and (not isinstance(mb, int) or mb < 0):
        raise FlagError("--cache-memory-mb", f"must be an integer >= 0, got {mb}")
    if percent is None or not (isinstance(percent, (int, float)) and math.isfinite(percent) and 0.0 < percent <= 1.0):
        raise FlagError("--cache-memory-percent", f"must be in (0, 1], got {percent}")
    if not enabled:
        return PrefixCacheSettings(False, 0)
    from ..host.engine_access import host_cache_budget_bytes

    return PrefixCacheSettings(True, host_cache_budget_bytes(mb, float(percent)))
