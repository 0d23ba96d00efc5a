"""The plugin API of vllm-mlx: pluggy hook specifications for the project ``vllm_mlx``.

A plugin is a module (or object) with functions marked ``@hookimpl`` whose names match the specs
below. Implementations may accept any subset of a spec's arguments, by name, so the spec can grow
without breaking plugins. Plugins are found through the entry-point group ``vllm_mlx.plugins`` and
only the ones named by ``--plugins`` / ``VLLM_MLX_PLUGINS`` load.

The same API (hook names, arguments, dataclass fields) ships upstream as ``vllm_mlx/plugins/hookspecs.py`` in
``patches/vllm-mlx-0.6.0-plugin-hooks.patch``; keep the two in step.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import pluggy

PROJECT_NAME = "vllm_mlx"
ENTRY_POINT_GROUP = "vllm_mlx.plugins"
HOOK_PREFIX = "vllm_mlx_"  # every hook name starts with it; a plugin function with it must match a spec

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass
class EngineContext:
    """Where and how the host built an engine.

    ``kind`` is ``"batched"`` or ``"simple"``; ``site`` is ``"load_model"`` (the default single
    model), ``"residency"`` (lifecycle residency / lazy load) or ``"registry"`` (``--models-config``).
    ``options`` are the keyword arguments the engine was constructed with; ``args`` the parsed CLI.
    """

    kind: str
    site: str
    options: dict[str, Any]
    args: argparse.Namespace | None = None


@dataclass
class ModelInfo:
    """A model the host has just loaded: the live model object, its local path and its config."""

    model: Any
    model_path: str
    config: dict[str, Any]
    is_mllm: bool
    processor: Any = None
    tokenizer: Any = None


@dataclass
class GenerationRequest:
    """One request on its way into the engine; pre-generation hooks may amend it in place.

    ``method`` is ``chat``, ``stream_chat``, ``generate`` or ``stream_generate``. For chat methods
    ``messages`` is set, for generate methods ``prompt``. ``options`` holds every other keyword the
    engine receives (max_tokens, temperature, tools, images, ...). ``headers`` are the HTTP request's
    headers (lower-case names) and ``body`` its JSON body (including fields the host's request models
    drop) when the request came through HTTP, else empty.
    """

    method: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def streaming(self) -> bool:
        return self.method.startswith("stream_")


@hookspec
def vllm_mlx_add_cli_args(parser: argparse.ArgumentParser, group: Any) -> None:
    """Add flags to ``vllm-mlx serve``.

    ``group`` is an argument group titled after the plugin: add flags there so ``--help`` shows whose
    they are. ``parser`` is the serve subparser. Use argparse ``type=``/``choices=`` for per-value
    checks: a bad value then exits 2 naming the flag.
    """


@hookspec
def vllm_mlx_validate_args(args: argparse.Namespace) -> None:
    """Check flag combinations once, before anything loads.

    Raise ``vllm_mlx_mtp_routing.plugin_api.errors.FlagError(flag, message)`` (or ``vllm_mlx.plugins.FlagError``
    upstream) for an impossible setting: the CLI prints it and exits 2.
    """


@hookspec
def vllm_mlx_wrap_engine(engine: Any, context: EngineContext) -> Any:
    """Wrap or replace an engine the host has just built (not started yet).

    Called at every place the host builds one (see ``EngineContext.site``). Return a new engine
    (a decorator exposing the wrapped engine as ``.wrapped`` keeps ``/v1/status`` and model hooks able
    to find the host's engine) or ``None`` to keep it. Implementations run in turn, each receiving the
    previous result.
    """


@hookspec
def vllm_mlx_model_loaded(engine: Any, info: ModelInfo) -> None:
    """The engine has started and its model is loaded, before the first request.

    Runs on the thread that owns the model's MLX state (for ``--mllm`` continuous batching: the
    event-loop thread). An implementation may return an awaitable; the host awaits it there.
    """


@hookspec
def vllm_mlx_pre_generate(request: GenerationRequest) -> None:
    """Inspect and amend one request before the engine sees it (messages, prompt, options).

    Raise ``vllm_mlx_mtp_routing.plugin_api.errors.RequestRejected`` to refuse it with an HTTP status; for
    streams the refusal is still a plain HTTP error, not an error frame in a 200 stream.
    """


@hookspec
def vllm_mlx_stats(engine: Any) -> dict[str, Any] | None:
    """Return this plugin's stats; they appear in ``/v1/status`` under ``plugins.<plugin name>``."""


@hookspec
def vllm_mlx_register_routes(router: Any) -> None:
    """Add HTTP routes to ``router`` (a FastAPI ``APIRouter``). Every route on it sits behind the
    host's own ``--api-key`` and ``--rate-limit`` dependencies."""
