"""What vllm-mlx 0.6.0's handlers assume of a request's JSON body, checked before they run (middleware.py): a 400
naming the field where a handler would trip over the body and answer 500.

- Every generation endpoint: its sampling parameters and ``cache_salt`` (routing/request_validation.py), before
  the handler builds anything from them (/v1/responses turns ``max_output_tokens: 0`` into a chat request that
  its own model refuses).
- /v1/messages and /v1/messages/count_tokens read the body themselves: the Anthropic request model's validation
  errors, ``system`` blocks and tool-result text that are not text, image sources without their data.
- /v1/chat/completions: a content part of a known type without its field (an ``image_url`` part without a URL).
- /v1/completions: an empty prompt.
- /v1/responses: input items the host converts without checking them (a message whose role is not a string, text
  that is not a string, a function call or output whose fields are not strings).

What the host's own request models refuse (a 422 naming the field) is left to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from ..plugin_api.errors import RequestRejected
from ..routing.request_validation import validate_parameters

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
URL_PARTS = ("image_url", "video_url", "audio_url")  # chat parts whose field holds a URL (or {"url": ...})


def check(path: str, body: dict[str, Any]) -> None:
    """RequestRejected(400) naming the first field of ``body`` that the handler of ``path`` cannot take."""
    if path == COUNT_TOKENS:
        _anthropic(body, counting=True)
        return
    validate_parameters(body)
    if path == MESSAGES:
        _anthropic(body, counting=False)
    elif path == "/v1/chat/completions":
        _chat_parts(body.get("messages"))
    elif path == "/v1/completions":
        _prompt(body.get("prompt"))
    elif path == "/v1/responses":
        _responses_input(body.get("input"))


def drop_nulls(path: str, body: dict[str, Any]) -> bool:
    """Top-level ``null`` fields of a token count removed (whether any were): the host's count reads them with
    ``body.get(key, default)``, which keeps an explicit null, and iterates it (``"tools": null`` was a 500)."""
    nulls = [key for key, value in body.items() if value is None] if path == COUNT_TOKENS else []
    for key in nulls:
        del body[key]
    return bool(nulls)


def _reject(message: str) -> NoReturn:
    raise RequestRejected(400, message)


def _field(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "body"


def _anthropic(body: dict[str, Any], *, counting: bool) -> None:
    """The host builds ``AnthropicRequest(**body)`` without catching its validation errors (a 500), and its token
    count reads the raw JSON as if the model had validated it."""
    from pydantic import ValidationError
    from vllm_mlx.api.anthropic_models import AnthropicRequest

    try:
        # A token count takes no max_tokens (Claude Code sends none); the model requires one.
        AnthropicRequest.model_validate({**body, "max_tokens": 1} if counting else body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        shown = "; ".join(f"{_field(e['loc'])}: {e['msg']}" for e in errors[:3])
        _reject(shown + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""))
    system = body.get("system")
    for i, block in enumerate(system if isinstance(system, list) else ()):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            _reject(f'system[{i}] must be a text block, {{"type": "text", "text": "..."}}')
    for i, message in enumerate(body["messages"]):
        content = message.get("content")
        for j, block in enumerate(content if isinstance(content, list) else ()):
            _anthropic_block(block, f"messages[{i}].content[{j}]")


def _text(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _anthropic_block(block: dict[str, Any], where: str) -> None:
    kind = block.get("type")
    if kind == "image":
        source = block.get("source")
        if not isinstance(source, dict):
            _reject(f"{where}: an image block needs its source")
        if source.get("type") == "base64":
            if not _text(source.get("data")) or not isinstance(source.get("media_type", ""), str):
                _reject(f"{where}.source: a base64 image source needs data (base64 text) and a media_type")
        elif source.get("type") == "url":
            if not _text(source.get("url")):
                _reject(f"{where}.source: a url image source needs its url")
        else:
            _reject(f"{where}.source.type must be 'base64' or 'url', got {str(source.get('type'))[:40]!r}")
    elif kind == "tool_result":
        content = block.get("content")
        for k, item in enumerate(content if isinstance(content, list) else ()):
            if isinstance(item, dict) and item.get("type") == "text" and not isinstance(item.get("text", ""), str):
                _reject(f"{where}.content[{k}].text must be a string")


def _url(value: Any) -> bool:
    return _text(value) or (isinstance(value, dict) and _text(value.get("url")))


def _chat_parts(messages: Any) -> None:
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                _reject(f"{where} must be a content part (an object with a type, a string)")
            kind = part["type"]
            if kind == "text" and not isinstance(part.get("text"), str):
                _reject(f"{where}: a text part needs its text (a string)")
            if kind in URL_PARTS and not _url(part.get(kind)):
                _reject(f'{where}: an {kind} part needs {kind} (a URL, or {{"url": ...}})')


def _prompt(prompt: Any) -> None:
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts or any(p == "" for p in prompts):
        _reject("prompt must not be empty")


RESPONSES_TEXT_PARTS = ("text", "input_text", "output_text")
# The string fields of the Responses items the host turns into chat messages (vllm-mlx 0.6.0
# ``server._responses_input_to_chat_messages``), unchecked when an item falls to its model's plain-dict branch.
RESPONSES_ITEM_STRINGS = {"message": ("role",), "function_call": ("call_id", "name", "arguments"),
                          "function_call_output": ("call_id", "output")}


def _responses_input(items: Any) -> None:
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            continue  # the host's request model refuses it (422)
        where = f"input[{i}]"
        kind = item.get("type") or ("message" if "role" in item else "")
        for key in RESPONSES_ITEM_STRINGS.get(kind, ()) if isinstance(kind, str) else ():
            if key in item and not isinstance(item[key], str):
                _reject(f"{where}.{key} must be a string")
        if kind in ("message", "reasoning"):
            _responses_content(item.get("content"), f"{where}.content", reasoning=kind == "reasoning")


def _responses_content(content: Any, where: str, *, reasoning: bool) -> None:
    if content is None or (isinstance(content, str) and not reasoning):
        return
    if not isinstance(content, list):
        _reject(f"{where} must be a {'' if reasoning else 'string or a '}list of content parts")
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            continue  # skipped by the host's conversion
        if not isinstance(part.get("type", ""), str):
            _reject(f"{where}[{k}].type must be a string")
        if (reasoning or part.get("type") in RESPONSES_TEXT_PARTS) and not isinstance(part.get("text", ""), str):
            _reject(f"{where}[{k}].text must be a string")
