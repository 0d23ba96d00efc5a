"""Per-request routing around the host's BatchedEngine: text requests and chats with images to the TextModel's
continuous batch (an image request is a row of the same batch, its images through the VLM's vision tower), what the
text engine cannot serve (video, audio, media arguments, another model family) to the host's mlx-vlm path, intact.

Both paths step on the event-loop thread, where the host's MLLM scheduler already steps: MLX work
never runs on two threads at once. Fairness: each scheduler runs one step, then yields the loop, so
under mixed load text and media steps alternate and neither path waits for the other to drain.
A text prompt's template and tokenization (no MLX work) run on a worker thread (prompt_preparation).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..admission import AdmissionController, Ticket
from ..config import RoutingSettings
from ..host import asgi, engine_access as host, logprobs_response as host_logprobs, output_text as host_output, usage as host_usage
from ..host.status_fields import TextTotals, count_text_path
from ..plugin_api.engine_decorator import EngineDecorator
from ..plugin_api.errors import RequestRejected
from ..specprefill.settings import RequestChoice
from ..text_engine.engine import TextEngine
from ..text_engine.row_check import preflight
from ..text_engine.state import MediaInput, TextOutput
from . import routing_off
from .fallbacks import FallbackReasons
from .media import MEDIA_OPTIONS, has_media, media_items
from .media_prompt import MediaPrompt, prepare_media_chat
from .normalize import normalize_messages
from .outputs import host_call, host_stream, no_draft_outcome, to_generation_output
from .parts import ServingParts, TextPath
from .prompt_preparation import Marks, prepare_chat, prepare_raw
from .request_options import sampling_options, split_plugin_options, text_path_gap
from .request_validation import fit_to_context
from .stop_strings import cut as cut_stop_strings, of as stop_strings_of, result as stop_strings_result

logger = logging.getLogger("vllm_mlx_mtp_routing.routing")


@dataclass(frozen=True)
class _Call:
    """One call of the host's generation API (chat or completion), its plugin-only options taken out."""

    chat: bool
    messages: list[dict[str, Any]] | None  # chat, normalized
    prompt: str | None  # completion
    options: dict[str, Any]  # the host's keyword arguments
    plugin: dict[str, Any]
    priority: int

    @property
    def text_options(self) -> dict[str, Any]:
        return {**self.options, **self.plugin}


class RoutingEngine(EngineDecorator):
    """Decorates the host's BatchedEngine; the host engine keeps doing what it does.

    The host's public engine surface, deliberately: generation (``chat``, ``stream_chat``,
    ``generate``, ``stream_generate``), ``abort_request``, ``get_stats``, ``clear_runtime_caches``,
    ``is_healthy`` and ``stop`` are served here for both paths; ``FORWARDED`` names what only the host's
    engine has (its mlx-vlm prefix cache, its model and tokenizer, ``start``: the text path starts from
    the model-loaded hook once the host has loaded the model) and is read from it.

    Built before the host loads the model; ``attach`` hands it the parts built from the loaded model, once.
    """

    FORWARDED = frozenset({
        "start", "get_cache_stats", "save_cache_to_disk", "load_cache_from_disk", "clear_prefix_cache", "prepare_for_start",
        "is_mllm", "model_name", "tokenizer", "preserve_native_tool_format",
    })

    # The decorator's own attributes (EngineDecorator: every other write goes to the host's engine).
    _own_attrs = frozenset({"wrapped", "settings", "routes", "fallbacks", "disabled_reason", "totals", "_parts", "_text"})

    def __init__(self, wrapped: Any, settings: RoutingSettings) -> None:
        super().__init__(wrapped)
        self.settings = settings
        self.routes: Counter[str] = Counter(text=0, media=0, fallback=0)
        self.fallbacks = FallbackReasons()
        self.totals = TextTotals()  # finished text requests: the host's own counters see only its path
        self.disabled_reason: str | None = "model not loaded yet"
        self._parts: ServingParts | None = None  # attached once the model is loaded
        self._text: TextPath | None = None  # the text path, once its engine runs
        if settings.enable_mtp and host.disable_mllm_mtp(wrapped):
            logger.info(
                "MTP moved off the mlx-vlm path (the host's MLLM MTP drops image embeddings), so the host's "
                "'MTP: MLLM path ...' line above no longer applies: text and image requests get MTP on the text path "
                "(stats: /v1/status mtp and plugins.mtp-routing.mtp); requests left on the mlx-vlm path (video, "
                "audio) decode without it"
            )

    # -- lifecycle ---------------------------------------------------------------------------

    def attach(self, parts: ServingParts) -> None:
        """The parts built from the loaded model; without a text path every request goes to the host's."""
        if self._parts is not None:
            raise RuntimeError("the routing engine's parts are attached once")
        self._parts = parts
        if parts.text is None:
            self.disabled_reason = parts.text_unavailable
            routing_off.no_text_path(str(parts.text_unavailable)).log()

    async def start_text_path(self) -> None:
        text = self._attached().text
        if text is None:
            raise RuntimeError(f"no text path to start: {self.disabled_reason}")
        await text.engine.start()
        self._text = text
        self.disabled_reason = None

    async def stop(self) -> None:
        if self._text is not None:
            await self._text.engine.stop()
        built = self._built_text
        if built is not None and built.prompts is not None:
            built.prompts.close()
        await self.wrapped.stop()

    @property
    def text_engine(self) -> TextEngine | None:
        """The text path's engine while it serves."""
        return self._text.engine if self._text is not None else None

    @property
    def admission(self) -> AdmissionController | None:
        return self._parts.admission if self._parts is not None else None

    @property
    def vocab_size(self) -> int | None:
        """The text model's vocabulary (token ids a request may name), once it is loaded."""
        built = self._built_text
        return built.vocab_size if built is not None else None

    @property
    def _built_text(self) -> TextPath | None:
        """The text path built from the loaded model, serving or not yet."""
        return self._parts.text if self._parts is not None else None

    def _attached(self) -> ServingParts:
        if self._parts is None:
            raise RuntimeError("the model is not loaded yet")
        return self._parts

    # -- the host's engine API ------------------------------------------------------------------

    async def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return await self._result(_chat(messages, kwargs))

    async def stream_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> AsyncIterator[Any]:
        async for out in self._stream(_chat(messages, kwargs)):
            yield out

    async def generate(self, prompt: str, **kwargs: Any) -> Any:
        return await self._result(_completion(prompt, kwargs))

    async def stream_generate(self, prompt: str, **kwargs: Any) -> AsyncIterator[Any]:
        async for out in self._stream(_completion(prompt, kwargs)):
            yield out

    async def abort_request(self, request_id: str) -> bool:
        """Cancel by id (``POST /v1/requests/{id}/cancel``): a text-engine id, the response id of a
        stream (``chatcmpl-...`` from its first chunk), else the host's own request ids."""
        if self._text is not None and self._text.engine.abort_now(request_id):
            return True
        if asgi.cancel_by_response_id(request_id):
            return True
        return bool(await self.wrapped.abort_request(request_id))

    def get_stats(self) -> dict[str, Any]:
        """The host's stats with the text path's requests counted in (``/health``, ``/v1/status``)."""
        stats = dict(self.wrapped.get_stats())
        if self._text is not None:
            text = self._text.engine.counts()
            stats["num_running"] = int(stats.get("num_running") or 0) + text["running"] + text["prefilling"]
            stats["num_waiting"] = int(stats.get("num_waiting") or 0) + text["waiting"]
        if self.admission is not None:
            stats["num_waiting"] = int(stats.get("num_waiting") or 0) + self.admission.queued
        if self._text is not None:
            engine = self._text.engine
            count_text_path(stats, self.totals, engine.scheduler.steps, engine.prefix_cache)
        built = self._built_text
        if self.settings.enable_mtp or (built is not None and built.drafts):
            # The host's own /v1/status `mtp` block: MTP runs on the text path, never on the mlx-vlm path here.
            text_mtp = built.mtp.stats() if built is not None and built.mtp is not None else {"enabled": False}
            stats["mtp"] = {**text_mtp, "path": "text", "mlx_vlm_path": "off (its MTP ignores images)"}
        return stats

    def clear_runtime_caches(self) -> dict[str, Any] | None:
        """The host's caches, and the MLX buffer cache the text path leaves behind."""
        import mlx.core as mx

        result = self.wrapped.clear_runtime_caches()
        before = mx.get_cache_memory()
        mx.clear_cache()
        text = {"buffer_cache_bytes_freed": int(before - mx.get_cache_memory())}
        return {**result, "text_path": text} if isinstance(result, dict) else {"host": result, "text_path": text}

    async def _clear_runtime_caches_on_owner(self) -> dict[str, Any] | None:
        # Both schedulers step on the event-loop thread, which owns the arrays: clear here.
        return self.clear_runtime_caches()

    def is_healthy(self) -> bool:
        text_ok = self._text is None or self._text.engine.running
        return bool(self.wrapped.is_healthy()) and text_ok

    def routing_stats(self) -> dict[str, Any]:
        on = {"enabled": True} if self.disabled_reason is None else routing_off.no_text_path(self.disabled_reason).status()
        stats: dict[str, Any] = {"routing": {**on, **self.routes}, "text_path": self.disabled_reason is None}
        stats["fallback_reasons"] = self.fallbacks.counts()
        stats["host_path_ignored"] = self.fallbacks.ignored_counts()
        if self.disabled_reason is not None:
            stats["text_path_disabled_reason"] = self.disabled_reason
        engine = self.text_engine
        if engine is not None:
            stats["text_engine"] = engine.stats()
        built = self._built_text
        if built is not None:
            stats["prefill"] = built.prefill_budget.stats()
        if self.admission is not None:
            stats["admission"] = self.admission.stats()
        stats["mtp"] = built.mtp.stats() if built is not None and built.mtp is not None else {"enabled": False}
        cache = engine.prefix_cache if engine is not None else None
        stats["prefix_cache"] = cache.stats() if cache is not None else {"enabled": False}
        sparse = engine.specprefill if engine is not None else None
        stats["specprefill"] = sparse.metrics.stats() if sparse is not None else {"enabled": False}
        return stats

    # -- serving: one path for chat and completion, a result or a stream -------------------------

    async def _result(self, call: _Call) -> Any:
        text = self._route(call)
        if text is None:
            tokens = self._media_prompt_tokens(call) if self.admission else 0
            stops = stop_strings_of(call.options)  # the host drops stop strings on its path: applied here
            ticket = await self._admit("media", tokens, call.options, call.priority)
            try:
                if stops:
                    result = await host_call(stop_strings_result(self._host_stream(call), stops))
                else:
                    result = await host_call(self._host_result(call))
                return host_output.without_cut_character(result)
            finally:
                if ticket is not None:
                    ticket.release()
        ids, marks, media = await self._prompt(text, call)
        last: TextOutput | None = None
        async for out in self._text_stream(text, ids, call.text_options, call.priority, marks, media):
            last = out
        assert last is not None
        return to_generation_output(last, streaming=False)

    async def _stream(self, call: _Call) -> AsyncIterator[Any]:
        text = self._route(call)
        if text is None:
            tokens = self._media_prompt_tokens(call) if self.admission else 0
            ticket = await self._admit("media", tokens, call.options, call.priority)
            try:
                async for out in host_stream(cut_stop_strings(self._host_stream(call), stop_strings_of(call.options))):
                    host_usage.record(prompt_tokens=out.prompt_tokens or None, finish_reason=out.finish_reason)
                    yield out
            finally:
                if ticket is not None:
                    ticket.release()
            return
        ids, marks, media = await self._prompt(text, call)
        async for out in self._text_stream(text, ids, call.text_options, call.priority, marks, media):
            yield to_generation_output(out, streaming=True)

    def _host_result(self, call: _Call) -> Any:
        if call.chat:
            return self.wrapped.chat(messages=call.messages, **call.options)
        return self.wrapped.generate(prompt=call.prompt, **call.options)

    def _host_stream(self, call: _Call) -> AsyncGenerator[Any, None]:
        if call.chat:
            return self.wrapped.stream_chat(messages=call.messages, **call.options)
        return self.wrapped.stream_generate(prompt=call.prompt, **call.options)

    def _route(self, call: _Call) -> TextPath | None:
        """The text path that serves this call (text, or media as rows of the text batch), or None: the host's path
        (a fallback, with its reason)."""
        reason = None
        text = self._text
        media = has_media(call.messages, call.options)
        if text is None:
            route, reason = "fallback", f"{'media' if media else 'text'} path off: {self.disabled_reason}"
        elif media and (why := _media_gap(text, call)) is not None:
            route, reason = "fallback", f"media: {why}"
        elif (reason := text_path_gap(call.options, text_mtp=text.drafts)) is not None:
            route = "fallback"
        else:
            route = "media" if media else "text"
        sibling = getattr(asgi.current(), "sibling", None)
        if sibling is None or sibling.index == 0:  # the n copies of one request count once
            _log_route(route, reason, call)
            self.routes[route] += 1
            if reason is not None:
                self.fallbacks.note(reason)
            if route == "fallback" and call.plugin.get("seed") is not None and float(call.options.get("temperature") or 0.0) > 0:
                self.fallbacks.ignored("seed")
        return text if route != "fallback" else None

    def _render(self, messages: list[dict[str, Any]], options: dict[str, Any], images: int = 0) -> str:
        try:
            return host.render_chat_prompt(self.wrapped, messages, options, images)
        except Exception as exc:  # a template's own error is the client's to fix: 400, not 500
            raise RequestRejected(400, f"chat template error: {exc}") from exc

    async def _media_prompt(self, text: TextPath, call: _Call) -> MediaPrompt:
        """A chat with images: its tokens (each image expanded) and its images, prepared off the event loop."""
        vision = text.vision
        assert vision is not None  # _route sends media here only with the vision parts
        render = lambda m, n: self._render(m, call.options, n)  # noqa: E731
        kwargs: dict[str, Any] = {
            "image_token_id": vision.image_token_id, "merge": vision.merge, "positions": text.engine.prefix_cache is not None,
        }
        if text.prompts is None:
            return prepare_media_chat(host.processor(self.wrapped), render, call.messages or [], **kwargs)
        return await text.prompts.media(prepare_media_chat, render, call.messages or [], **kwargs)

    async def _prompt(self, text: TextPath, call: _Call) -> tuple[list[int], Marks, MediaInput | None]:
        """The prompt's tokens, where it is worth a snapshot (with a prefix cache) and its images (off the event loop)."""
        if has_media(call.messages, call.options):
            prepared = await self._media_prompt(text, call)
            return prepared.ids, prepared.marks, prepared.media
        ids, marks = await self._text_prompt(text, call)
        return ids, marks, None

    async def _text_prompt(self, text: TextPath, call: _Call) -> tuple[list[int], Marks]:
        tokenizer, context = self._attached().tokenizer, self._attached().context_tokens
        if not call.chat:
            prompt = call.prompt or ""
            ids = prepare_raw(tokenizer, prompt, context) if text.prompts is None else await text.prompts.raw(prompt, context)
            # The host's --warm-prompts start-up sends each system prefix as a raw prompt.
            return ids, [(len(ids) - 1, "system")] if prompt in text.warm_prefixes else []
        render = lambda m: self._render(m, call.options)  # noqa: E731
        messages = call.messages or []
        positions = text.engine.prefix_cache is not None
        if text.prompts is None:
            return prepare_chat(tokenizer, render, messages, positions=positions, context_tokens=context)
        return await text.prompts.chat(render, messages, positions=positions, context_tokens=context,
                                       space=call.plugin.get("cache_salt"))

    def _fit_context(self, prompt_tokens: int, options: dict[str, Any]) -> None:
        """400 before any prefill when the prompt alone cannot fit the model's context; a max_tokens that overflows it
        is cut to what the prompt leaves (admission then projects the cut one), or refused under --strict-max-tokens
        when the client set it."""
        parts = self._attached()
        strict = parts.strict_max_tokens and _explicit_max_tokens(asgi.current())
        max_tokens = int(options.get("max_tokens") or 256)
        fitted = fit_to_context(prompt_tokens, max_tokens, parts.context_tokens, strict=strict)
        if fitted != max_tokens:
            options["max_tokens"] = fitted

    async def _admit(self, path: str, prompt_tokens: int, options: dict[str, Any], priority: int) -> Ticket | None:
        """Wait for room, or raise RequestRejected (503 busy, 413 never fits) before any output exists.

        The slot is released when the HTTP request ends, however it ends (``asgi.on_request_end``); a
        request still waiting when its HTTP request ends is withdrawn from the queue.
        """
        ctx = asgi.current()
        if ctx is not None:
            ctx.waiting_since = time.monotonic()
        admission = self.admission
        if admission is None:
            return None
        max_wait = host.request_wait_limit(ctx.body) if ctx is not None else None
        waiting_task = asyncio.current_task()
        waiting = [True]
        asgi.on_request_end(lambda: waiting[0] and waiting_task is not None and waiting_task.cancel())
        try:
            ticket = await admission.acquire(
                prompt_tokens=prompt_tokens, max_tokens=int(options.get("max_tokens") or 256), priority=priority, path=path,
                max_wait_s=max_wait,
            )
        finally:
            waiting[0] = False
        asgi.on_request_end(ticket.release)
        return ticket

    def _media_prompt_tokens(self, call: _Call) -> int:
        """A projection, not a count: the host expands each image after admission, so every media item is
        taken at the processor's bound (see tokens_per_media_item). The text alone must fit the context."""
        parts = self._attached()
        prompt = self._render(call.messages or [], call.options) if call.chat else call.prompt
        text_tokens = len(parts.tokenizer.encode(prompt or "", add_special_tokens=False))
        self._fit_context(text_tokens, call.options)
        return text_tokens + media_items(call.messages, call.options) * parts.tokens_per_media_item

    async def _text_stream(
        self, text: TextPath, prompt_ids: list[int], options: dict[str, Any], priority: int, snapshot_at: Marks,
        media: MediaInput | None = None,
    ) -> AsyncIterator[TextOutput]:
        if not prompt_ids:  # an empty completion prompt: nothing to continue from
            raise RequestRejected(400, "prompt must not be empty")
        self._fit_context(len(prompt_ids), options)
        host_usage.record(prompt_tokens=len(prompt_ids))  # a stream's first event reports it, before any output
        try:
            sampling = sampling_options(options)
            preflight(sampling)
            sparse = RequestChoice.from_options(options)
        except ValueError as exc:  # RowOptionsError included: this request's own options, its own 400
            raise RequestRejected(400, str(exc)) from exc
        engine = text.engine
        if sparse.enabled and engine.specprefill is None:
            logger.info("SpecPrefill requested, but the server runs without --specprefill --specprefill-draft-model: dense prefill")
        # A media row's vision tower works over its images' tokens on top of the prompt: counted as prompt tokens again.
        vision_tokens = sum(end - start for start, end in media.spans) if media is not None else 0
        ticket = await self._admit("text" if media is None else "media", len(prompt_ids) + vision_tokens, options, priority)
        request_id: str | None = None
        finished = False
        rid = f"text-{uuid.uuid4().hex[:12]}"
        asgi.on_request_end(lambda: engine.abort_now(rid, forget=True))
        ctx = asgi.current()
        if ctx is not None:
            ctx.cancel = lambda: engine.abort_now(rid)
        sibling = getattr(ctx, "sibling", None)
        tokenizer = self._attached().tokenizer
        try:
            request_id = await engine.add_request(
                prompt_ids, sampling, rid, snapshot_at,
                # the prefill working set is given back once the row joins the batch
                on_joined=ticket.prefill_done if ticket is not None else None,
                share=sibling.share if sibling is not None else None,  # OpenAI n: the rows prefill once
                specprefill=sparse,
                cache_salt=options.get("cache_salt"),
                media=media,
            )
            async for out in engine.stream(request_id):
                finished = out.finished
                if finished:
                    self.totals.finished(out.prompt_tokens, out.completion_tokens)
                if sparse.enabled and out.specprefill is None:  # asked for, but the server has no draft
                    out.specprefill = no_draft_outcome(len(prompt_ids))
                host_usage.record(cached_tokens=out.cached_tokens, finish_reason=out.finish_reason)
                if out.logprobs is not None:
                    host_logprobs.record(tokenizer, out)
                yield out
        finally:
            if request_id is not None and not finished:  # client went away or the task was cancelled
                engine.abort_now(request_id)
            if ticket is not None:
                ticket.release()


def _media_gap(text: TextPath, call: _Call) -> str | None:
    """Why the text engine cannot serve this media call (None: it can)."""
    if text.vision is None:
        return text.media_unavailable or "no vision tower"
    if not call.chat or any(call.options.get(k) for k in MEDIA_OPTIONS):
        return "media passed as arguments, not as message parts"
    images, videos, audios = host.media_references(call.messages or [])
    if audios:
        return "audio"
    if videos:
        return "video"
    if not images:  # a media part the host's extraction does not read: its path, as without the plugin
        return "a media part the host does not read"
    return None


def _log_route(route: str, reason: str | None, call: _Call) -> None:
    """One line per request at the host's request-log level (its ``[REQUEST]`` lines are INFO)."""
    if route == "text":
        logger.info("[ROUTE] text path")
    elif route == "media":
        logger.info("[ROUTE] text path, media rows: %d image(s)", media_items(call.messages, call.options))
    else:
        logger.info("[ROUTE] mlx-vlm path (fallback): %s", reason)


def _explicit_max_tokens(ctx: asgi.RequestContext | None) -> bool:
    """Whether the client set the request's output limit (a call from outside HTTP passes it itself). The host's
    /v1/responses handler leaves the body unread here: its ``max_output_tokens`` counts as not set."""
    return ctx is None or any(k in ctx.body for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"))


def _chat(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> _Call:
    plugin, priority = split_plugin_options(kwargs)
    return _Call(True, normalize_messages(messages), None, kwargs, plugin, priority)


def _completion(prompt: str, kwargs: dict[str, Any]) -> _Call:
    plugin, priority = split_plugin_options(kwargs)
    return _Call(False, None, prompt, kwargs, plugin, priority)
