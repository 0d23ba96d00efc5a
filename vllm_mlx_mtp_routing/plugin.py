"""The ``mtp-routing`` plugin: its hook implementations, each short; the work is in ``config`` (flags),
``assembly`` (the parts built from the loaded model) and ``routing`` (serving requests).

The plugin is an object, a new one each time its entry point (``vllm_mlx_mtp_routing.plugin:plugin``) is loaded:
the pre-generation hook receives only the request, so what it needs (whether this plugin routes, the loaded
vocabulary) is reached through the plugin that wrapped the engine, not through module state.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable
from typing import Any

from . import __version__, config, gc_pauses
from .assembly import assemble
from .config import PluginConfig, RoutingSettings
from .host import engine_access
from .plugin_api.engine_decorator import find_decorator
from .plugin_api.hookspecs import EngineContext, GenerationRequest, ModelInfo, hookimpl
from .routing import RoutingEngine, request_options

logger = logging.getLogger("vllm_mlx_mtp_routing")


class MTPRoutingPlugin:
    def __init__(self) -> None:
        self.config = PluginConfig()  # the flags, once they are validated
        self.router: RoutingEngine | None = None  # the engine this plugin routes for; requests are checked for it

    @hookimpl
    def vllm_mlx_add_cli_args(self, group: Any) -> None:
        config.add_arguments(group)

    @hookimpl
    def vllm_mlx_validate_args(self, args: argparse.Namespace) -> None:
        self.config = PluginConfig.from_args(args)

    @hookimpl
    def vllm_mlx_wrap_engine(self, engine: Any, context: EngineContext) -> Any:
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
        drafter_path, _ = engine_access.host_mtp_drafter(engine)
        if drafter_path is not None:
            logger.info("mtp-routing: the text path drafts with the host's MTP drafter %s (--mllm-draft-model)", drafter_path)
        self.router = RoutingEngine(engine, RoutingSettings.from_host_engine(engine))
        return self.router

    @hookimpl
    def vllm_mlx_model_loaded(self, engine: Any, info: ModelInfo) -> Awaitable[None] | None:
        router: RoutingEngine | None = find_decorator(engine, RoutingEngine)
        if router is None:
            return None
        parts = assemble(info, router.wrapped, router.settings, self.config)
        router.attach(parts)
        if parts.text is None:
            return None
        started = router.start_text_path()
        gc_pauses.freeze_startup_heap()
        return started

    @hookimpl
    def vllm_mlx_pre_generate(self, request: GenerationRequest) -> None:
        if self.router is not None:
            request_options.amend(request, vocab_size=self.router.vocab_size)

    @hookimpl
    def vllm_mlx_stats(self, engine: Any) -> dict[str, Any]:
        stats: dict[str, Any] = {"version": __version__}
        router: RoutingEngine | None = find_decorator(engine, RoutingEngine)
        if router is not None:
            stats.update(router.routing_stats())
        else:
            stats["routing"] = None
        return stats


def __getattr__(name: str) -> Any:
    # The entry point's object: a new plugin per load, so its state belongs to the manager that registered it.
    if name == "plugin":
        return MTPRoutingPlugin()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
