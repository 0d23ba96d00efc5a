"""What the bridge's CLI half (bridge.py) loaded for one ``vllm-mlx serve``, handed to its server half
(server_hooks.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BridgeState:
    """What one ``vllm-mlx serve`` invocation loaded; the server half reads it."""

    names: list[str]
    pm: Any
    plugins: list[Any]
    serve_parser: argparse.ArgumentParser
    args: argparse.Namespace | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    # Defaults of the flags the plugins added: a namespace built without them (a program calling
    # serve_command itself, as the host's own tests do) gets these.
    plugin_defaults: dict[str, Any] = field(default_factory=dict)
