"""The server half of the bridge: engine factories, model/request hooks, status and routes.

Host internals of vllm-mlx 0.6.0 used here, each read at call time by the host: ``server.BatchedEngine``
/ ``server.SimpleEngine`` (``load_model``), ``server._build_engine`` (lifecycle residency),
``model_registry.BatchedEngine`` / ``model_registry.SimpleEngine`` (``--models-config``), the
``/v1/status`` route, ``server.verify_api_key`` / ``server.check_rate_limit``, and
``server._responses_input_to_chat_messages`` (responses_input.py).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from ..plugin_api.errors import RequestRejected
from ..plugin_api.hookspecs import EngineContext
from . import asgi, replica_info, responses_input
from .bridge_state import BridgeState
from .hooked_engine import HookedEngine
from .middleware import PluginRequestMiddleware

logger = logging.getLogger("vllm_mlx_mtp_routing.bridge")

_INSTALLED_MARK = "_vllm_mlx_plugin_hooks"


def wrap_engine(state: BridgeState, engine: Any, kind: str, site: str, options: dict[str, Any]) -> Any:
    context = EngineContext(kind=kind, site=site, options=options, args=state.args)
    for impl in state.pm.hook.vllm_mlx_wrap_engine.get_hookimpls():  # registration order: first named wraps first
        kwargs = {"engine": engine, "context": context}
        result = impl.function(**{a: kwargs[a] for a in impl.argnames})
        if result is not None:
            engine = result
    return HookedEngine(engine, state.pm)


def _factory(state: BridgeState, cls: Any, kind: str, site: str) -> Callable[..., Any]:
    @functools.wraps(cls, updated=())
    def build(*args: Any, **kwargs: Any) -> Any:
        # The class as its home module has it now: the host (load_model's SimpleEngine lookup) and its
        # tests replace it there (vllm_mlx.engine.simple.SimpleEngine), and that must keep working.
        current = getattr(sys.modules.get(cls.__module__), cls.__name__, cls)
        if hasattr(current, "__wrapped_engine_class__"):
            current = cls
        return wrap_engine(state, current(*args, **kwargs), kind, site, kwargs)

    build.__wrapped_engine_class__ = cls  # type: ignore[attr-defined]
    return build


def install(state: BridgeState) -> None:
    from vllm_mlx import model_registry, server
    from vllm_mlx.engine.batched import BatchedEngine
    from vllm_mlx.engine.simple import SimpleEngine

    if getattr(server, _INSTALLED_MARK, False):
        return
    setattr(server, _INSTALLED_MARK, True)

    server.BatchedEngine = _factory(state, BatchedEngine, "batched", "load_model")
    server.SimpleEngine = _factory(state, SimpleEngine, "simple", "load_model")
    model_registry.BatchedEngine = _factory(state, BatchedEngine, "batched", "registry")
    model_registry.SimpleEngine = _factory(state, SimpleEngine, "simple", "registry")

    build_engine = server._build_engine

    @functools.wraps(build_engine)
    def _build_engine(spec: Any) -> Any:
        engine = build_engine(spec)
        kind = "batched" if getattr(spec, "use_batching", False) else "simple"
        return wrap_engine(state, engine, kind, "residency", dict(vars(spec)) if hasattr(spec, "__dict__") else {})

    server._build_engine = _build_engine
    responses_input.install(server)

    app = server.app
    try:
        app.add_middleware(PluginRequestMiddleware)
    except RuntimeError:
        # The app has served already (an in-process client before serve_command, as in the host's own
        # tests): Starlette 1.x refuses add_middleware then, but rebuilds a cleared stack on the next call.
        from starlette.middleware import Middleware

        app.user_middleware.insert(0, Middleware(PluginRequestMiddleware))
        app.middleware_stack = None
    app.add_exception_handler(RequestRejected, _rejected_handler)
    logging.getLogger("vllm_mlx.server").addFilter(asgi.RefusalLogFilter())
    _replace_status_route(state, server)
    _register_plugin_routes(state, server)
    replica_info.install(server)


async def _rejected_handler(request: Any, exc: Exception) -> Any:
    from fastapi.responses import JSONResponse

    assert isinstance(exc, RequestRejected)
    return JSONResponse(asgi.error_body(exc), status_code=exc.status_code, headers=asgi.error_headers(exc))


def plugin_stats(state: BridgeState, engine: Any) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for impl in state.pm.hook.vllm_mlx_stats.get_hookimpls():
        kwargs = {"engine": engine}
        try:
            result = impl.function(**{a: kwargs[a] for a in impl.argnames})
        except Exception as exc:  # one plugin's broken stats must not break /v1/status
            logger.warning("Plugin %s stats failed: %s", impl.plugin_name, exc)
            result = {"error": str(exc)}
        if result is not None:
            stats[impl.plugin_name] = result
    for plugin in state.plugins:
        stats.setdefault(plugin.name, {})
    return stats


def _replace_status_route(state: BridgeState, server: Any) -> None:
    from fastapi import Depends
    from fastapi.routing import APIRoute

    app = server.app
    old = next((r for r in app.router.routes if isinstance(r, APIRoute) and r.path == "/v1/status" and "GET" in (r.methods or ())), None)
    if old is None:
        logger.warning("No /v1/status route found; plugin stats are served on /v1/plugins only")
        return
    app.router.routes.remove(old)
    host_status = old.endpoint

    @functools.wraps(host_status)
    async def status() -> Any:
        body = await host_status()
        if isinstance(body, dict):
            engine = server._engine
            body["plugins"] = plugin_stats(state, engine) if engine is not None else {}
        return body

    app.add_api_route("/v1/status", status, methods=["GET"], dependencies=[Depends(server.verify_api_key)])


def _register_plugin_routes(state: BridgeState, server: Any) -> None:
    from fastapi import APIRouter, Depends

    router = APIRouter(dependencies=[Depends(server.verify_api_key), Depends(server.check_rate_limit)])

    @router.get("/v1/plugins")
    async def list_plugins() -> dict[str, Any]:
        return {"plugins": [{"name": p.name, "version": p.version, "module": p.module} for p in state.plugins]}

    state.pm.hook.vllm_mlx_register_routes(router=router)
    server.app.include_router(router)

