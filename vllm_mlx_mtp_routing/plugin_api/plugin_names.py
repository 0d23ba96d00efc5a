"""Which plugins a command line asks for. Dependency-free: it runs before anything else is imported,
so a run without ``--plugins`` pays for nothing more."""

from __future__ import annotations

import os
from collections.abc import Iterable

ENV_VAR = "VLLM_MLX_PLUGINS"


def parse_names(value: str | None) -> list[str]:
    """``"a, b,a"`` -> ``["a", "b"]``: order kept, duplicates and blanks dropped."""
    names: list[str] = []
    for part in (value or "").split(","):
        part = part.strip()
        if part and part not in names:
            names.append(part)
    return names


def requested_names(argv: Iterable[str], environ: dict[str, str] | None = None) -> list[str]:
    """Plugin names from ``--plugins`` in argv (all occurrences) and the environment variable."""
    env = os.environ if environ is None else environ
    names = parse_names(env.get(ENV_VAR))
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--plugins" and i + 1 < len(args):
            names += [n for n in parse_names(args[i + 1]) if n not in names]
        elif arg.startswith("--plugins="):
            names += [n for n in parse_names(arg.split("=", 1)[1]) if n not in names]
    return names
