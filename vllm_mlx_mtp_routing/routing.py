"""Per-request routing around the host's BatchedEngine: text-only requests to the TextModel's
continuous batch, anything with an image, video or audio part to the host's mlx-vlm path, intact.

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
from dataclasses import dataclass
from typing import Any, AsyncIterator

from .plugin_api.engine_decorator import EngineDecorator
from .plugin_api.errors import RequestRejected
from . import stop_strings
from .fallbacks import FallbackReasons
from .host import asgi
from .host import engine_access as host
from .host import logprobs_response as host_logprobs
from .host import output_text as host_output
from .host import usage as host_usage
from .normalize import normalize_messages
from .prompt_preparation import prepare_chat, prepare_raw
from .request_validation import fit_to_context
from .specprefill.pipeline import OUTCOME_REASONS, outcome
from .specprefill.settings import RequestChoice
from .text_engine.state import TextOutput
from .text_engine.row_check import preflight
from .text_engine.sampling import SamplingOptions

logger = logging.getLogger("vllm_mlx_mtp_routing.routing")

MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image", "video_url", "input_video", "video", "input_audio", "audio_url", "audio"}
)
MEDIA_PART_KEYS = ("image_url", "input_image", "video_url", "input_audio", "audio_url")
MEDIA_OPTIONS = ("images", "videos", "audio")
# Options the plugin's pre-generation hook adds; the host's engine never sees them.
PLUGIN_OPTIONS = ("priority", "seed", "frequency_penalty", "logprobs", "top_logprobs")


def _is_media_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in MEDIA_PART_TYPES or any(k in part for k in MEDIA_PART_KEYS))


def _media_parts(messages: list[dict[str, Any]] | None) -> int:
    count = 0
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            count += sum(1 for part in content if _is_media_part(part))
    return count


def has_media(messages: list[dict[str, Any]] | None, options: dict[str, Any]) -> bool:
    return any(options.get(k) for k in MEDIA_OPTIONS) or _media_parts(messages) > 0


def text_path_gap(options: dict[str, Any], *, text_mtp: bool = False) -> str | None:
    """Why the text path cannot serve these options exactly as the host would (None: it can).

    `text_mtp`: the text path drafts with an MTP head (the host's own drafter when one is
    configured), so a request asking for the host's drafter (`mllm_draft`) is served there."""
    if options.get("mllm_draft") and not text_mtp:
        return "a host drafter was requested and the text path has no MTP head"
    return None


def sampling_options(options: dict[str, Any]) -> SamplingOptions:
    stop = options.get("stop") or []
    return SamplingOptions(
        max_tokens=int(options.get("max_tokens") or 256),
        temperature=float(options.get("temperature") or 0.0),
        top_p=float(options.get("top_p") if options.get("top_p") is not None else 1.0),
        top_k=int(options.get("top_k") or 0),
        min_p=float(options.get("min_p") or 0.0),
        seed=options.get("seed"),
        stop=[stop] if isinstance(stop, str) else list(stop),
        logits_processors=list(options.get("logits_processors") or ()),
        presence_penalty=float(options.get("presence_penalty") or 0.0),
        frequency_penalty=float(options.get("frequency_penalty") or 0.0),
        repetition_penalty=float(options.get("repetition_penalty") or 1.0),
        logprobs=bool(options.get("logprobs")),
        top_logprobs=int(options.get("top_logprobs") or 0),
    )


def no_draft_outcome(prompt_tokens: int) -> dict:
    return outcome(True, OUTCOME_REASONS["no_draft"], prompt_tokens - 1)


def to_generation_output(out: TextOutput, *, streaming: bool) -> Any:
    return host.GenerationOutput(
        text=host.clean_output_text(out.text),
        tokens=list(out.token_ids) if not streaming else [],
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        finish_reason=out.finish_reason,
        new_text=out.new_text,
        finished=out.finished,
        mtp_drafts=out.mtp_drafted,
        mtp_accepted=out.mtp_accepted,
        specprefill_outcome=host.specprefill_outcome(out.specprefill),
    )


@dataclass
class RoutingSettings:
    enable_mtp: bool = False
    mtp_num_draft_tokens: int = 1
    max_num_seqs: int = 16
    prefill_step_size: int = 2048


class RoutingEngine(EngineDecorator):
    """Decorates the host's BatchedEngine; the host engine keeps doing what it does.

    The host's public engine surface, deliberately: generation (``chat``, ``stream_chat``,
    ``generate``, ``stream_generate``), ``abort_request``, ``get_stats``, ``clear_runtime_caches``,
    ``is_healthy`` and ``stop`` are served here for both paths; ``FORWARDED`` names what only the host's
    engine has (its mlx-vlm prefix cache, its model and tokenizer, ``start``: the text path starts from
    the model-loaded hook once the host has loaded the model) and is read from it.
    """

    FORWARDED = frozenset({
        "start", "get_cache_stats", "save_cache_to_disk", "load_cache_from_disk", "clear_prefix_cache", "prepare_for_start",
        "is_mllm", "model_name", "tokenizer", "preserve_native_tool_format",
    })

    _own_attrs = frozenset({
        "wrapped", "settings", "text_engine", "tokenizer_for_text", "routes", "disabled_reason", "admission",
        "tokens_per_media_item", "mtp_decode", "context_tokens", "prefill_budget", "warm_prefixes", "fallbacks", "prompts",
    })

    def __init__(self, wrapped: Any, settings: RoutingSettings) -> None:
        super().__init__(wrapped)
        self.settings = settings
        self.text_engine: Any = None
        self.tokenizer_for_text: Any = None
        self.routes: Counter[str] = Counter(text=0, media=0, fallback=0)
        self.fallbacks = FallbackReasons()
        self.disabled_reason: str | None = "model not loaded yet"
        self.admission: Any = None  # an admission.AdmissionController once the model is loaded
        self.tokens_per_media_item = 0
        self.context_tokens: int | None = None  # the model's context (max_position_embeddings), once loaded
        self.mtp_decode: Any = None  # the text path's MTP decode strategy, when MTP is on
        self.prefill_budget: Any = None  # text_engine.prefill_budget.PrefillBudget, once calibrated
        self.warm_prefixes: frozenset[str] = frozenset()  # --warm-prompts prefixes: their snapshots are system prefixes
        self.prompts: Any = None  # a prompt_preparation.PromptPreparer once the model is loaded: text prompts off the loop
        if settings.enable_mtp and host.disable_mllm_mtp(wrapped):
            logger.info(
                "MTP moved off the mlx-vlm path (the host's MLLM MTP drops image embeddings), so the host's "
                "'MTP: MLLM path ...' line above no longer applies: text requests get MTP on the text path "
                "(stats: /v1/status mtp and plugins.mtp-routing.mtp); media requests decode without it"
            )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start_text_path(self, text_engine: Any) -> None:
        await text_engine.start()
        self.text_engine = text_engine
        self.disabled_reason = None

    def disable_text_path(self, reason: str) -> None:
        self.disabled_reason = reason
        logger.warning("Text routing disabled, every request goes to the MLLM path: %s", reason)

    async def stop(self) -> None:
        if self.text_engine is not None:
            await self.text_engine.stop()
        if self.prompts is not None:
            self.prompts.close()
        await self.wrapped.stop()

    # -- routing -----------------------------------------------------------------------------

    @property
    def text_path_drafts(self) -> bool:
        return getattr(self.mtp_decode, "k", 0) > 0  # an MTPDecode, not a status-only placeholder

    def _route(self, messages: list[dict[str, Any]] | None, options: dict[str, Any], plugin: dict[str, Any] | None = None) -> str:
        reason = None
        if has_media(messages, options):
            route = "media"
        elif self.text_engine is None:
            route, reason = "fallback", f"text path off: {self.disabled_reason}"
        elif (reason := text_path_gap(options, text_mtp=self.text_path_drafts)) is not None:
            route = "fallback"
        else:
            route = "text"
        sibling = getattr(asgi.current(), "sibling", None)
        if sibling is None or sibling.index == 0:  # the n copies of one request count once
            self.routes[route] += 1
            if reason is not None:
                self.fallbacks.note(reason)
            if route != "text" and (plugin or {}).get("seed") is not None and float(options.get("temperature") or 0.0) > 0:
                self.fallbacks.ignored("seed")
        return route

    def _encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer_for_text.encode(prompt, add_special_tokens=False))

    def _render(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> str:
        try:
            return host.render_chat_prompt(self.wrapped, messages, options)
        except Exception as exc:  # a template's own error is the client's to fix: 400, not 500
            raise RequestRejected(400, f"chat template error: {exc}") from exc

    async def _text_prompt(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> tuple[list[int], list[tuple[int, str]]]:
        """The prompt's tokens and, with a prefix cache, where it is worth a snapshot (off the event loop)."""
        render = lambda m: self._render(m, options)  # noqa: E731
        positions = getattr(self.text_engine, "prefix_cache", None) is not None
        if self.prompts is None:
            return prepare_chat(self.tokenizer_for_text, render, messages, positions=positions)
        return await self.prompts.chat(render, messages, positions=positions)

    async def _raw_prompt(self, prompt: str) -> tuple[list[int], list[tuple[int, str]]]:
        ids = prepare_raw(self.tokenizer_for_text, prompt) if self.prompts is None else await self.prompts.raw(prompt)
        # The host's --warm-prompts start-up sends each system prefix as a raw prompt.
        return ids, [(len(ids) - 1, "system")] if prompt in self.warm_prefixes else []

    def _fit_context(self, prompt_tokens: int, options: dict[str, Any]) -> None:
        """400 before any prefill when the prompt cannot fit the model's context; a default max_tokens is cut to fit."""
        ctx = asgi.current()
        explicit = ctx is None or not ctx.body or any(k in ctx.body for k in ("max_tokens", "max_completion_tokens"))
        max_tokens = int(options.get("max_tokens") or 256)
        fitted = fit_to_context(prompt_tokens, max_tokens, self.context_tokens, explicit=explicit)
        if fitted != max_tokens:
            options["max_tokens"] = fitted

    async def _admit(self, path: str, prompt_tokens: int, options: dict[str, Any], priority: int) -> Any:
        """Wait for room, or raise RequestRejected (503 busy, 413 never fits) before any output exists.

        The slot is released when the HTTP request ends, however it ends (``asgi.on_request_end``); a
        request still waiting when its HTTP request ends is withdrawn from the queue.
        """
        ctx = asgi.current()
        if ctx is not None:
            ctx.waiting_since = time.monotonic()
        if self.admission is None:
            return None
        max_wait = host.request_wait_limit(ctx.body) if ctx is not None else None
        waiting_task = asyncio.current_task()
        waiting = [True]
        asgi.on_request_end(lambda: waiting[0] and waiting_task is not None and waiting_task.cancel())
        try:
            ticket = await self.admission.acquire(
                prompt_tokens=prompt_tokens, max_tokens=int(options.get("max_tokens") or 256), priority=priority, path=path,
                max_wait_s=max_wait,
            )
        finally:
            waiting[0] = False
        asgi.on_request_end(ticket.release)
        return ticket

    def _media_prompt_tokens(self, messages: list[dict[str, Any]] | None, prompt: str | None, options: dict[str, Any]) -> int:
        """A projection, not a count: the host expands each image after admission, so every media item is
        taken at the processor's bound (see tokens_per_media_item). The text alone must fit the context."""
        if messages is not None:
            prompt = self._render(messages, options)
        items = sum(len(options.get(k) or ()) for k in MEDIA_OPTIONS) + _media_parts(messages)
        text_tokens = len(self._encode(prompt or ""))
        self._fit_context(text_tokens, options)
        return text_tokens + items * self.tokens_per_media_item

    async def _text_stream(
        self, prompt_ids: list[int], options: dict[str, Any], priority: int, snapshot_at: list[tuple[int, str]] | None = None
    ) -> AsyncIterator[TextOutput]:
        self._fit_context(len(prompt_ids), options)
        try:
            sampling = sampling_options(options)
            preflight(sampling)
            sparse = RequestChoice.from_options(options)
        except ValueError as exc:  # RowOptionsError included: this request's own options, its own 400
            raise RequestRejected(400, str(exc)) from exc
        if sparse.enabled and getattr(self.text_engine, "specprefill", None) is None:
            logger.info("SpecPrefill requested, but the server runs without --specprefill --specprefill-draft-model: dense prefill")
        ticket = await self._admit("text", len(prompt_ids), options, priority)
        request_id: str | None = None
        finished = False
        engine = self.text_engine
        rid = f"text-{uuid.uuid4().hex[:12]}"
        asgi.on_request_end(lambda: engine.abort_now(rid, forget=True))
        ctx = asgi.current()
        if ctx is not None:
            ctx.cancel = lambda: engine.abort_now(rid)
        sibling = getattr(ctx, "sibling", None)
        try:
            request_id = await engine.add_request(
                prompt_ids, sampling, rid, snapshot_at,
                # the prefill working set is given back once the row joins the batch
                on_joined=ticket.prefill_done if ticket is not None else None,
                share=sibling.share if sibling is not None else None,  # OpenAI n: the rows prefill once
                specprefill=sparse,
            )
            async for out in self.text_engine.stream(request_id):
                finished = out.finished
                if sparse.enabled and out.specprefill is None:  # asked for, but the server has no draft
                    out.specprefill = no_draft_outcome(len(prompt_ids))
                host_usage.record(out.cached_tokens)
                if out.logprobs is not None:
                    host_logprobs.record(self.tokenizer_for_text, out)
                yield out
        finally:
            if request_id is not None and not finished:  # client went away or the task was cancelled
                engine.abort_now(request_id)
            if ticket is not None:
                ticket.release()

    async def _text_result(
        self, prompt_ids: list[int], options: dict[str, Any], priority: int, snapshot_at: list[tuple[int, str]] | None = None
    ) -> Any:
        last: TextOutput | None = None
        async for out in self._text_stream(prompt_ids, options, priority, snapshot_at):
            last = out
        assert last is not None
        return to_generation_output(last, streaming=False)

    async def _media_result(self, call: Any, tokens: int, options: dict[str, Any], priority: int) -> Any:
        ticket = await self._admit("media", tokens, options, priority)
        try:
            return host_output.without_cut_character(await _host_call(call()))
        finally:
            if ticket is not None:
                ticket.release()

    async def _media_stream(self, stream: Any, tokens: int, options: dict[str, Any], priority: int) -> AsyncIterator[Any]:
        ticket = await self._admit("media", tokens, options, priority)
        try:
            async for out in _host_stream(stream()):
                yield out
        finally:
            if ticket is not None:
                ticket.release()

    # -- the host's engine API ------------------------------------------------------------------

    async def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        plugin, priority = _split_plugin_options(kwargs)
        messages = normalize_messages(messages)
        if self._route(messages, kwargs, plugin) != "text":
            tokens = self._media_prompt_tokens(messages, None, kwargs) if self.admission else 0
            stops = stop_strings.of(kwargs)  # the host drops stop strings on this path: applied here
            call = (lambda: stop_strings.result(self.wrapped.stream_chat(messages=messages, **kwargs), stops)) if stops else (
                lambda: self.wrapped.chat(messages=messages, **kwargs))
            return await self._media_result(call, tokens, kwargs, priority)
        ids, marks = await self._text_prompt(messages, kwargs)
        return await self._text_result(ids, {**kwargs, **plugin}, priority, marks)

    async def stream_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> AsyncIterator[Any]:
        plugin, priority = _split_plugin_options(kwargs)
        messages = normalize_messages(messages)
        if self._route(messages, kwargs, plugin) != "text":
            tokens = self._media_prompt_tokens(messages, None, kwargs) if self.admission else 0
            stream = lambda: stop_strings.cut(self.wrapped.stream_chat(messages=messages, **kwargs), stop_strings.of(kwargs))  # noqa: E731
            async for out in self._media_stream(stream, tokens, kwargs, priority):
                yield out
            return
        ids, marks = await self._text_prompt(messages, kwargs)
        async for out in self._text_stream(ids, {**kwargs, **plugin}, priority, marks):
            yield to_generation_output(out, streaming=True)

    async def generate(self, prompt: str, **kwargs: Any) -> Any:
        plugin, priority = _split_plugin_options(kwargs)
        if self._route(None, kwargs, plugin) != "text":
            tokens = self._media_prompt_tokens(None, prompt, kwargs) if self.admission else 0
            stops = stop_strings.of(kwargs)
            call = (lambda: stop_strings.result(self.wrapped.stream_generate(prompt=prompt, **kwargs), stops)) if stops else (
                lambda: self.wrapped.generate(prompt=prompt, **kwargs))
            return await self._media_result(call, tokens, kwargs, priority)
        ids, marks = await self._raw_prompt(prompt)
        return await self._text_result(ids, {**kwargs, **plugin}, priority, marks)

    async def stream_generate(self, prompt: str, **kwargs: Any) -> AsyncIterator[Any]:
        plugin, priority = _split_plugin_options(kwargs)
        if self._route(None, kwargs, plugin) != "text":
            tokens = self._media_prompt_tokens(None, prompt, kwargs) if self.admission else 0
            stream = lambda: stop_strings.cut(self.wrapped.stream_generate(prompt=prompt, **kwargs), stop_strings.of(kwargs))  # noqa: E731
            async for out in self._media_stream(stream, tokens, kwargs, priority):
                yield out
            return
        ids, marks = await self._raw_prompt(prompt)
        async for out in self._text_stream(ids, {**kwargs, **plugin}, priority, marks):
            yield to_generation_output(out, streaming=True)

    async def abort_request(self, request_id: str) -> bool:
        """Cancel by id (``POST /v1/requests/{id}/cancel``): a text-engine id, the response id of a
        stream (``chatcmpl-...`` from its first chunk), else the host's own request ids."""
        if self.text_engine is not None and self.text_engine.abort_now(request_id):
            return True
        if asgi.cancel_by_response_id(request_id):
            return True
        return bool(await self.wrapped.abort_request(request_id))

    def get_stats(self) -> dict[str, Any]:
        """The host's stats with the text path's requests counted in (``/health``, ``/v1/status``)."""
        stats = dict(self.wrapped.get_stats())
        if self.text_engine is not None:
            text = self.text_engine.counts()
            stats["num_running"] = int(stats.get("num_running") or 0) + text["running"] + text["prefilling"]
            stats["num_waiting"] = int(stats.get("num_waiting") or 0) + text["waiting"]
        if self.admission is not None:
            stats["num_waiting"] = int(stats.get("num_waiting") or 0) + self.admission.queued
        if self.settings.enable_mtp or self.text_path_drafts:
            # The host's own /v1/status `mtp` block: MTP runs on the text path, never on the mlx-vlm path here.
            text_mtp = self.mtp_decode.stats() if self.mtp_decode is not None else {"enabled": False}
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
        text_ok = self.text_engine is None or self.text_engine.running
        return bool(self.wrapped.is_healthy()) and text_ok

    def routing_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"routing": dict(self.routes), "text_path": self.disabled_reason is None}
        stats["fallback_reasons"] = self.fallbacks.counts()
        stats["host_path_ignored"] = self.fallbacks.ignored_counts()
        if self.disabled_reason is not None:
            stats["text_path_disabled_reason"] = self.disabled_reason
        if self.text_engine is not None:
            stats["text_engine"] = self.text_engine.stats()
        if self.prefill_budget is not None:
            stats["prefill"] = self.prefill_budget.stats()
        if self.admission is not None:
            stats["admission"] = self.admission.stats()
        stats["mtp"] = self.mtp_decode.stats() if self.mtp_decode is not None else {"enabled": False}
        cache = getattr(self.text_engine, "prefix_cache", None)
        stats["prefix_cache"] = cache.stats() if cache is not None else {"enabled": False}
        sparse = getattr(self.text_engine, "specprefill", None)
        stats["specprefill"] = sparse.metrics.stats() if sparse is not None else {"enabled": False}
        return stats


def _split_plugin_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Take the plugin-only options out of the host's kwargs (in place); return them and the priority."""
    plugin = {k: kwargs.pop(k) for k in PLUGIN_OPTIONS if k in kwargs}
    return plugin, int(plugin.get("priority", 0))


def _is_template_error(exc: BaseException) -> bool:
    import jinja2

    return isinstance(exc, jinja2.TemplateError)


async def _host_call(call: Any) -> Any:
    try:
        return await call
    except Exception as exc:
        if _is_template_error(exc):
            raise RequestRejected(400, f"chat template error: {exc}") from exc
        raise


async def _host_stream(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        async for out in stream:
            yield out
    except Exception as exc:
        if _is_template_error(exc):
            raise RequestRejected(400, f"chat template error: {exc}") from exc
        raise
