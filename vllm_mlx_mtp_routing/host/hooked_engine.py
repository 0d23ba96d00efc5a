"""The outermost engine decorator: fires ``model_loaded`` after start and ``pre_generate`` per request."""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..plugin_api.engine_decorator import EngineDecorator, innermost
from ..plugin_api.errors import RequestRejected
from ..plugin_api.hookspecs import GenerationRequest, ModelInfo
from . import asgi

logger = logging.getLogger("vllm_mlx_mtp_routing.bridge")


def model_info(host_engine: Any) -> ModelInfo | None:
    """What the host loaded (vllm-mlx 0.6.0 internals: ``_model``, ``_model_path``, ``_processor``)."""
    model = getattr(host_engine, "_model", None)
    if model is None:
        return None
    path = str(getattr(host_engine, "_model_path", None) or getattr(host_engine, "model_name", ""))
    config: dict[str, Any] = {}
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
    return ModelInfo(
        model=model,
        model_path=path,
        config=config,
        is_mllm=bool(getattr(host_engine, "is_mllm", False)),
        processor=getattr(host_engine, "_processor", None),
        tokenizer=getattr(host_engine, "tokenizer", None),
    )


class HookedEngine(EngineDecorator):
    _own_attrs = frozenset({"wrapped", "_pm"})

    def __init__(self, wrapped: Any, pm: Any) -> None:
        super().__init__(wrapped)
        object.__setattr__(self, "_pm", pm)

    async def start(self) -> None:
        already = bool(getattr(innermost(self.wrapped), "_loaded", False))
        await self.wrapped.start()
        if already:
            return
        info = model_info(innermost(self.wrapped))
        if info is None:
            return
        for result in self._pm.hook.vllm_mlx_model_loaded(engine=self, info=info):
            if inspect.isawaitable(result):
                await result

    def _pre(self, method: str, **fields: Any) -> GenerationRequest:
        ctx = asgi.current()
        request = GenerationRequest(method=method, headers=dict(ctx.headers) if ctx else {}, body=dict(ctx.body) if ctx else {}, **fields)
        self._pm.hook.vllm_mlx_pre_generate(request=request)
        return request

    # A RequestRejected raised here reaches the client through the exception handler that
    # server_hooks installs: the same {"error": ...} body and Retry-After as a refused stream.
    async def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        req = self._pre("chat", messages=messages, options=kwargs)
        return await self.wrapped.chat(messages=req.messages, **req.options)

    async def generate(self, prompt: str, **kwargs: Any) -> Any:
        req = self._pre("generate", prompt=prompt, options=kwargs)
        return await self.wrapped.generate(prompt=req.prompt, **req.options)

    async def stream_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> AsyncIterator[Any]:
        async for out in self._stream("stream_chat", {"messages": messages}, kwargs):
            yield out

    async def stream_generate(self, prompt: str, **kwargs: Any) -> AsyncIterator[Any]:
        async for out in self._stream("stream_generate", {"prompt": prompt}, kwargs):
            yield out

    async def _stream(self, method: str, fields: dict[str, Any], kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        ctx = asgi.current()
        try:
            req = self._pre(method, options=kwargs, **fields)
            call = {"messages": req.messages} if method == "stream_chat" else {"prompt": req.prompt}
            async for out in getattr(self.wrapped, method)(**call, **req.options):
                if ctx is not None:
                    ctx.engine_started = True
                yield out
        except RequestRejected as exc:
            if ctx is not None:
                ctx.refused = True
            if ctx is not None and ctx.stream_started:
                # Too late for a status: the host's stream wrapper writes an HTTPException's status and
                # detail into its terminal error frame (vllm-mlx 0.6.0 server._stream_error_payload).
                from fastapi import HTTPException

                raise HTTPException(exc.status_code, detail=exc.message) from exc
            if ctx is not None and not ctx.engine_started:
                ctx.rejection = exc  # the middleware turns this into the HTTP status
            raise
        finally:
            if ctx is not None:
                ctx.engine_started = True
