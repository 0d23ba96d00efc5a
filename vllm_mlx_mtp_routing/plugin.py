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
from .host import drain, engine_access
from .plugin_api.engine_decorator import find_decorator
from .plugin_api.hookspecs import EngineContext, GenerationRequest, ModelInfo, hookimpl
from .routing import RoutingEngine, request_options, routing_off

logger = logging.getLogger("vllm_mlx_mtp_routing")


class MTPRoutingPlugin:
    def __init__(self) -> None:
        self.config = PluginConfig()  # the flags, once they are validated
        self.router: RoutingEngine | None = None  # the engine this plugin routes for; requests are checked for it
        self.off: routing_off.RoutingOff | None = None  # why an engine was left unwrapped

    @hookimpl
    def vllm_mlx_add_cli_args(self, group: Any) -> None:
        config.add_arguments(group)

    @hookimpl
    def vllm_mlx_validate_args(self, args: argparse.Namespace) -> None:
        self.config = PluginConfig.from_args(args)
        drain.DRAIN.configure(None if self.config.drain_timeout == float("inf") else self.config.drain_timeout)

    @hookimpl
    def vllm_mlx_wrap_engine(self, engine: Any, context: EngineContext) -> Any:
        args = context.args
        off = None
        if args is not None and getattr(args, "mtp_routing_disable", False):
            off = routing_off.by_flag()
        elif context.kind != "batched":
            off = routing_off.no_continuous_batching()
        elif not getattr(engine, "is_mllm", False):
            off = routing_off.not_a_vlm(str(getattr(engine, "model_name", None) or "the model"))
        if off is not None:
            if self.off is None:  # once, whatever number of engines the host builds
                off.log()
            self.off = off
            return None
        drafter_path, _ = engine_access.host_mtp_drafter(engine)
        if drafter_path is not None:
            logger.info("mtp-routing: the text path drafts with the host's MTP drafter %s (--mllm-draft-model)", drafter_path)
        self.router = RoutingEngine(engine, RoutingSettings.from_host_engine(engine))
        return self.router

    @hookimpl
    def vllm_mlx_model_loaded(self, engine: Any, info: ModelInfo) -> Awaitable[None] | None:
        drain.DRAIN.arm()  # the server's stop signals are installed by now (the lifespan's start)
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
            stats["routing"] = (self.off or routing_off.RoutingOff("the engine is not routed", None)).status()
        return stats


def __getattr__(name: str) -> Any:
    # The entry point's object: a new plugin per load, so its state belongs to the manager that registered it.
    if name == "plugin":
        return MTPRoutingPlugin()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
