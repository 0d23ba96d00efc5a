"""Per-response prompt usage the host's responses lack (vllm-mlx 0.6.0 internals).

The host builds ``Usage(prompt_tokens=..., ...)`` (OpenAI, ``vllm_mlx.api.models``),
``ResponsesUsage`` (``/v1/responses``, ``vllm_mlx.api.responses_models``) and
``AnthropicUsage(input_tokens=..., ...)`` itself from a ``GenerationOutput`` that has no field for
cached tokens. The routing engine records a request's prompt tokens, reused tokens and finish reason on
the plugin's per-request context (``asgi.current()``, shared by every task the request's handler
starts), and the usage models read them when they are built: OpenAI gains
``prompt_tokens_details.cached_tokens`` (as OpenAI and mlx-lm's server report it), ``/v1/responses``
fills its ``input_tokens_details.cached_tokens``, Anthropic's existing ``cache_read_input_tokens`` is
filled and, as Anthropic counts them, taken out of ``input_tokens`` (input + cache reads = the prompt).
Requests the text path did not serve leave them as the host has them.

A streamed Anthropic response is written by the host as SSE text with ``input_tokens: 0`` in its
``message_start`` and no input usage in its ``message_delta``: those two events are amended on their
way out (``amend_anthropic_sse``): the prompt and its cache reads as Anthropic counts them, and
``stop_reason: "max_tokens"`` where the host says ``end_turn`` for a response cut by ``max_tokens``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pydantic import BaseModel, model_validator
from pydantic.fields import FieldInfo

from . import asgi


def record(*, prompt_tokens: int | None = None, cached_tokens: int | None = None, finish_reason: str | None = None) -> None:
    """What the current request's usage reports, as it becomes known (call from the engine side): its prompt's
    tokens (before any output), the prompt tokens it reused, how its generation ended. None: not known (yet)."""
    ctx = asgi.current()
    if ctx is None:
        return
    if prompt_tokens is not None:
        ctx.prompt_tokens = prompt_tokens
    if cached_tokens is not None:
        ctx.cached_tokens = cached_tokens
    if finish_reason is not None:
        ctx.finish_reason = finish_reason
    if amend_anthropic_sse not in ctx.body_filters:
        ctx.body_filters.append(amend_anthropic_sse)


def _cached() -> int | None:
    return getattr(asgi.current(), "cached_tokens", None)


def _anthropic_usage(usage: dict[str, Any], ctx: asgi.RequestContext) -> None:
    """A streamed event's usage with the prompt as Anthropic counts it: input + cache reads = the prompt."""
    cached = ctx.cached_tokens
    if ctx.prompt_tokens is not None:
        usage["input_tokens"] = max(0, ctx.prompt_tokens - (cached or 0))
    if cached is not None:
        usage["cache_read_input_tokens"] = cached


def _amend_anthropic_event(event: bytes, ctx: asgi.RequestContext) -> bytes:
    name, _, data = event.partition(b"\ndata: ")
    if name not in (b"event: message_start", b"event: message_delta"):
        return event
    try:
        obj = json.loads(data)
    except ValueError:
        return event
    if name == b"event: message_start" and isinstance(obj.get("message"), dict):
        _anthropic_usage(obj["message"].setdefault("usage", {}), ctx)
    elif name == b"event: message_delta":
        _anthropic_usage(obj.setdefault("usage", {}), ctx)
        delta = obj.get("delta")
        if ctx.finish_reason == "length" and isinstance(delta, dict) and delta.get("stop_reason") == "end_turn":
            delta["stop_reason"] = "max_tokens"  # as the host's non-streamed response says it
    return name + b"\ndata: " + json.dumps(obj).encode()


def amend_anthropic_sse(message: dict[str, Any]) -> dict[str, Any]:
    """A streamed Anthropic ``message_start`` / ``message_delta`` with the usage recorded so far (a body filter,
    applied as the event leaves: ``message_start`` is held until the first output or a long wait)."""
    body = message.get("body", b"")
    ctx = asgi.current()
    if ctx is None or message.get("type") != "http.response.body" or not body.startswith(b"event: message_"):
        return message
    events = [_amend_anthropic_event(e, ctx) for e in body.split(b"\n\n")]
    return {**message, "body": b"\n\n".join(events)}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


def _openai_details() -> PromptTokensDetails | None:
    n = _cached()
    return None if n is None else PromptTokensDetails(cached_tokens=n)


def _anthropic_cache_read() -> int | None:
    return _cached()


_installed = False


def install() -> None:
    """Add the fields (idempotent); models that embed the usage models are rebuilt to see them."""
    global _installed
    if _installed:
        return
    from vllm_mlx.api import anthropic_models, models, responses_models

    models.Usage.model_fields["prompt_tokens_details"] = FieldInfo(
        annotation=Optional[PromptTokensDetails], default_factory=_openai_details  # noqa: UP045 - a value pydantic reads at run time, left as it was
    )
    anthropic_models.AnthropicUsage.model_fields["cache_read_input_tokens"] = FieldInfo(
        annotation=Optional[int], default_factory=_anthropic_cache_read  # noqa: UP045 - a value pydantic reads at run time, left as it was
    )
    # /v1/responses: the host builds its input details with the class's defaults (cached_tokens 0)
    details = responses_models.ResponsesInputTokenDetails
    details.model_fields["cached_tokens"] = FieldInfo(annotation=int, default_factory=lambda: _cached() or 0)
    details.model_rebuild(force=True)
    for module, base in ((models, models.Usage), (anthropic_models, anthropic_models.AnthropicUsage)):
        base.model_rebuild(force=True)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseModel) and value is not base:
                if any(_mentions(f.annotation, base) for f in value.model_fields.values()):
                    value.model_rebuild(force=True)
    _count_cache_reads_apart(anthropic_models.AnthropicUsage)
    _installed = True


def _count_cache_reads_apart(base: type[BaseModel]) -> None:
    """Anthropic's ``input_tokens`` excludes ``cache_read_input_tokens``; the host fills it with the whole
    prompt. A subclass with that rule replaces the name where the host builds non-streamed usage
    (vllm-mlx 0.6.0: ``server`` and ``api.anthropic_adapter`` import it by name); an instance of it is
    still an ``AnthropicUsage`` wherever one is expected."""
    from vllm_mlx import server
    from vllm_mlx.api import anthropic_adapter, anthropic_models

    class AnthropicUsage(base):  # type: ignore[misc, valid-type]
        @model_validator(mode="after")
        def _reads_apart(self) -> Any:
            reads = getattr(self, "cache_read_input_tokens", None)
            if reads:
                self.input_tokens = max(0, self.input_tokens - reads)  # type: ignore[has-type]
            return self

    for module in (server, anthropic_adapter, anthropic_models):
        if getattr(module, "AnthropicUsage", None) is base:
            module.AnthropicUsage = AnthropicUsage


def _mentions(annotation: Any, cls: type) -> bool:
    if annotation is cls:
        return True
    return any(_mentions(a, cls) for a in getattr(annotation, "__args__", ()) or ())
