"""The ``mtp-routing`` plugin: hook wiring only; each capability lives in its own module."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from . import __version__
from .engine_decorator import find_decorator
from .hookspecs import EngineContext, ModelInfo, hookimpl
from .host import engine_access
from .routing import RoutingEngine, RoutingSettings

logger = logging.getLogger("vllm_mlx_mtp_routing")


@hookimpl
def vllm_mlx_add_cli_args(group: Any) -> None:
    group.add_argument(
        "--mtp-routing-disable",
        action="store_true",
        help="Load the plugin but leave the engine as the host built it (every request on the host's path).",
    )


@hookimpl
def vllm_mlx_wrap_engine(engine: Any, context: EngineContext) -> Any:
    args = context.args
    if args is not None and getattr(args, "mtp_routing_disable", False):
        logger.info("mtp-routing: routing disabled by --mtp-routing-disable")
        return None
    if context.kind != "batched":
        logger.info("mtp-routing: routing needs --continuous-batching; the engine is left as the host built it")
        return None
    if not getattr(engine, "is_mllm", False):
        logger.info("mtp-routing: %s is not served as a VLM (--mllm); nothing to route", getattr(engine, "model_name", "model"))
        return None
    settings = RoutingSettings(
        enable_mtp=bool(engine_access.scheduler_setting(engine, "enable_mtp", False)),
        max_num_seqs=int(engine_access.scheduler_setting(engine, "max_num_seqs", 16)),
        prefill_step_size=int(engine_access.scheduler_setting(engine, "prefill_step_size", 2048)),
    )
    return RoutingEngine(engine, settings)


@hookimpl
def vllm_mlx_model_loaded(engine: Any, info: ModelInfo) -> Any:
    router = find_decorator(engine, RoutingEngine)
    if router is None:
        return None
    from .text_engine.engine import TextEngine
    from .text_model import TextModelUnavailable, build_text_model

    try:
        bundle = build_text_model(info.model, Path(info.model_path), info.config, enable_mtp=router.settings.enable_mtp)
    except TextModelUnavailable as exc:
        router.disable_text_path(str(exc))
        return None
    text_engine = TextEngine(
        bundle.model,
        info.tokenizer,
        max_num_seqs=router.settings.max_num_seqs,
        prefill_step_size=router.settings.prefill_step_size,
    )
    return router.start_text_path(text_engine, info.tokenizer)


@hookimpl
def vllm_mlx_stats(engine: Any) -> dict[str, Any]:
    stats: dict[str, Any] = {"version": __version__}
    router = find_decorator(engine, RoutingEngine)
    if router is not None:
        stats.update(router.routing_stats())
    else:
        stats["routing"] = None
    return stats
