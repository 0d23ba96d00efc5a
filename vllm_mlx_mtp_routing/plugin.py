"""The ``mtp-routing`` plugin: hook wiring only; each capability lives in its own module."""

from __future__ import annotations

import argparse
from typing import Any

from . import __version__
from .hookspecs import EngineContext, hookimpl


@hookimpl
def vllm_mlx_add_cli_args(group: Any) -> None:
    group.add_argument(
        "--mtp-routing-disable",
        action="store_true",
        help="Load the plugin but send every request down the host's own path (for A/B comparisons).",
    )


@hookimpl
def vllm_mlx_validate_args(args: argparse.Namespace) -> None:
    return None


@hookimpl
def vllm_mlx_wrap_engine(engine: Any, context: EngineContext) -> Any:
    return None


@hookimpl
def vllm_mlx_stats(engine: Any) -> dict[str, Any]:
    return {"version": __version__}
