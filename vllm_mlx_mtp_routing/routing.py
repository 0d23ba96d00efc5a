"""Per-request routing around the host's BatchedEngine: text-only requests to the TextModel's
continuous batch, anything with an image, video or audio part to the host's mlx-vlm path, intact.

Both paths step on the event-loop thread, where the host's MLLM scheduler already steps: MLX work
never runs on two threads at once. Fairness: each scheduler runs one step, then yields the loop, so
under mixed load text and media steps alternate and neither path waits for the other to drain.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator

from .engine_decorator import EngineDecorator
from .errors import RequestRejected
from .host import engine_access as host
from .normalize import normalize_messages
from .text_engine.outputs import TextOutput
from .text_engine.sampling import SamplingOptions

logger = logging.getLogger("vllm_mlx_mtp_routing.routing")

MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image", "video_url", "input_video", "video", "input_audio", "audio_url", "audio"}
)
MEDIA_PART_KEYS = ("image_url", "input_image", "video_url", "input_audio", "audio_url")
MEDIA_OPTIONS = ("images", "videos", "audio")
# Options the plugin's pre-generation hook adds; the host's engine never sees them.
PLUGIN_OPTIONS = ("priority", "seed")


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
    if options.get("logits_processors"):
        return "logits processors (logit_bias, JSON mode, thinking budget)"
    if float(options.get("presence_penalty") or 0.0) != 0.0:
        return "presence_penalty"
    if float(options.get("repetition_penalty") or 1.0) != 1.0:
        return "repetition_penalty"
    if options.get("specprefill"):
        return "SpecPrefill was requested"
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
    )


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
    )


@dataclass
class RoutingSettings:
    enable_mtp: bool = False
    mtp_num_draft_tokens: int = 1
    max_num_seqs: int = 16
    prefill_step_size: int = 2048


class RoutingEngine(EngineDecorator):
    """Decorates the host's BatchedEngine; the host engine keeps doing what it does."""

    _own_attrs = frozenset({
        "wrapped", "settings", "text_engine", "tokenizer_for_text", "routes", "disabled_reason", "admission",
        "tokens_per_media_item", "mtp_decode",
    })

    def __init__(self, wrapped: Any, settings: RoutingSettings) -> None:
        super().__init__(wrapped)
        self.settings = settings
        self.text_engine: Any = None
        self.tokenizer_for_text: Any = None
        self.routes: Counter[str] = Counter(text=0, media=0, fallback=0)
        self.disabled_reason: str | None = "model not loaded yet"
        self.admission: Any = None  # an admission.AdmissionController once the model is loaded
        self.tokens_per_media_item = 0
        self.mtp_decode: Any = None  # the text path's MTP decode strategy, when MTP is on
        if settings.enable_mtp and host.disable_mllm_mtp(wrapped):
            logger.info("MTP moved off the mlx-vlm path (the host's MLLM MTP drops image embeddings); text requests get MTP")

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
        await self.wrapped.stop()

    # -- routing -----------------------------------------------------------------------------

    @property
    def text_path_drafts(self) -> bool:
        return getattr(self.mtp_decode, "k", 0) > 0  # an MTPDecode, not a status-only placeholder

    def _route(self, messages: list[dict[str, Any]] | None, options: dict[str, Any]) -> str:
        if has_media(messages, options):
            route = "media"
        elif self.text_engine is None or text_path_gap(options, text_mtp=self.text_path_drafts) is not None:
            route = "fallback"
        else:
            route = "text"
        self.routes[route] += 1
        return route

    def _encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer_for_text.encode(prompt, add_special_tokens=False))

    def _render(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> str:
        try:
            return host.render_chat_prompt(self.wrapped, messages, options)
        except Exception as exc:  # a template's own error is the client's to fix: 400, not 500
            raise RequestRejected(400, f"chat template error: {exc}") from exc

    def _text_prompt(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> list[int]:
        return self._encode(self._render(messages, options))

    async def _admit(self, path: str, prompt_tokens: int, options: dict[str, Any], priority: int) -> Any:
        """Wait for room, or raise RequestRejected (503 busy, 413 never fits) before any output exists."""
        if self.admission is None:
            return None
        return await self.admission.acquire(
            prompt_tokens=prompt_tokens, max_tokens=int(options.get("max_tokens") or 256), priority=priority, path=path
        )

    def _media_prompt_tokens(self, messages: list[dict[str, Any]] | None, prompt: str | None, options: dict[str, Any]) -> int:
        """A projection, not a count: the host expands each image after admission, so every media item is
        taken at the processor's bound (see tokens_per_media_item)."""
        if messages is not None:
            prompt = self._render(messages, options)
        items = sum(len(options.get(k) or ()) for k in MEDIA_OPTIONS) + _media_parts(messages)
        return len(self._encode(prompt or "")) + items * self.tokens_per_media_item

    async def _text_stream(self, prompt_ids: list[int], options: dict[str, Any], priority: int) -> AsyncIterator[TextOutput]:
        ticket = await self._admit("text", len(prompt_ids), options, priority)
        request_id: str | None = None
        finished = False
        try:
            request_id = await self.text_engine.add_request(prompt_ids, sampling_options(options), f"text-{uuid.uuid4().hex[:12]}")
            async for out in self.text_engine.stream(request_id):
                finished = out.finished
                yield out
        finally:
            if request_id is not None and not finished:  # client went away or the task was cancelled
                await self.text_engine.abort(request_id)
            if ticket is not None:
                ticket.release()

    async def _text_result(self, prompt_ids: list[int], options: dict[str, Any], priority: int) -> Any:
        last: TextOutput | None = None
        async for out in self._text_stream(prompt_ids, options, priority):
            last = out
        assert last is not None
        return to_generation_output(last, streaming=False)

    async def _media_result(self, call: Any, tokens: int, options: dict[str, Any], priority: int) -> Any:
        ticket = await self._admit("media", tokens, options, priority)
        try:
            return await _host_call(call())
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
        if self._route(messages, kwargs) != "text":
            tokens = self._media_prompt_tokens(messages, None, kwargs) if self.admission else 0
            return await self._media_result(lambda: self.wrapped.chat(messages=messages, **kwargs), tokens, kwargs, priority)
        return await self._text_result(self._text_prompt(messages, kwargs), {**kwargs, **plugin}, priority)

    async def stream_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> AsyncIterator[Any]:
        plugin, priority = _split_plugin_options(kwargs)
        messages = normalize_messages(messages)
        if self._route(messages, kwargs) != "text":
            tokens = self._media_prompt_tokens(messages, None, kwargs) if self.admission else 0
            async for out in self._media_stream(lambda: self.wrapped.stream_chat(messages=messages, **kwargs), tokens, kwargs, priority):
                yield out
            return
        async for out in self._text_stream(self._text_prompt(messages, kwargs), {**kwargs, **plugin}, priority):
            yield to_generation_output(out, streaming=True)

    async def generate(self, prompt: str, **kwargs: Any) -> Any:
        plugin, priority = _split_plugin_options(kwargs)
        if self._route(None, kwargs) != "text":
            tokens = self._media_prompt_tokens(None, prompt, kwargs) if self.admission else 0
            return await self._media_result(lambda: self.wrapped.generate(prompt=prompt, **kwargs), tokens, kwargs, priority)
        return await self._text_result(self._encode(prompt), {**kwargs, **plugin}, priority)

    async def stream_generate(self, prompt: str, **kwargs: Any) -> AsyncIterator[Any]:
        plugin, priority = _split_plugin_options(kwargs)
        if self._route(None, kwargs) != "text":
            tokens = self._media_prompt_tokens(None, prompt, kwargs) if self.admission else 0
            async for out in self._media_stream(lambda: self.wrapped.stream_generate(prompt=prompt, **kwargs), tokens, kwargs, priority):
                yield out
            return
        async for out in self._text_stream(self._encode(prompt), {**kwargs, **plugin}, priority):
            yield to_generation_output(out, streaming=True)

    def routing_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"routing": dict(self.routes), "text_path": self.disabled_reason is None}
        if self.disabled_reason is not None:
            stats["text_path_disabled_reason"] = self.disabled_reason
        if self.text_engine is not None:
            stats["text_engine"] = self.text_engine.stats()
        if self.admission is not None:
            stats["admission"] = self.admission.stats()
        stats["mtp"] = self.mtp_decode.stats() if self.mtp_decode is not None else {"enabled": False}
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
