"""Images in /v1/responses input, served on the media path.

vllm-mlx 0.6.0 (``server._responses_input_to_chat_messages``) keeps only the text of a message's
content parts, and a message given as a plain ``{"role", "content"}`` object (what the OpenAI SDK
sends, ``EasyInputMessage``) whose content holds an ``input_image`` part does not validate as its
message model: it is skipped as an item of unknown type. A request with an image then reached the
chat template with no messages ("list index out of range", a 400 counted as a text request). Here a
message with an ``input_image`` becomes a chat message with ``image_url`` parts, kept in place for
the mlx-vlm path as the host's chat handler keeps them; every other item is converted by the host's
own function. Parts that cannot be served (``file_id`` images, files, audio) and input with
no message at all are a 400 that says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..plugin_api.errors import RequestRejected

MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url")
TEXT_PARTS = ("text", "input_text", "output_text")


def _reject(message: str) -> None:
    raise RequestRejected(400, message)


def _image_url(part: dict[str, Any], where: str) -> str:
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if isinstance(url, str) and url:
        return url
    if part.get("file_id"):
        _reject(f"{where}: input_image by file_id is not supported (this server keeps no files); send image_url (a URL or a data: URL)")
    _reject(f"{where}: input_image needs image_url")
    raise AssertionError


def _chat_part(part: Any, where: str) -> dict[str, Any] | None:
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind in TEXT_PARTS:
        return {"type": "text", "text": str(part.get("text") or "")}
    if kind in ("input_image", "image_url"):
        chat = {"type": "image_url", "image_url": {"url": _image_url(part, where)}}
        from ..routing.request_validation import validate_inline_images

        try:
            validate_inline_images([{"content": [chat]}])
        except RequestRejected as exc:
            _reject(exc.message.replace("messages[0].content[0]", where))
        return chat
    if kind in MEDIA_PARTS:
        _reject(f"{where}: Responses input part {kind!r} is not supported; send input_text or input_image")
    return None


def media_message(item: Any, i: int) -> dict[str, Any] | None:
    """The chat message for a Responses message item with media parts (None: it has none)."""
    if not isinstance(item, dict) or item.get("type", "message") not in ("message", "", None):
        return None
    content = item.get("content")
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in content):
        return None
    role = "system" if item.get("role") == "developer" else str(item.get("role") or "user")
    if role != "user":
        _reject(f"input[{i}]: images are accepted in user messages only, not in a {role!r} message")
    parts = [p for k, part in enumerate(content) if (p := _chat_part(part, f"input[{i}].content[{k}]")) is not None]
    return {"role": role, "content": parts}


def with_media(original: Callable[[Any], list[dict[str, Any]]]) -> Callable[[Any], list[dict[str, Any]]]:
    @functools.wraps(original)
    def to_chat_messages(request: Any) -> list[dict[str, Any]]:
        if isinstance(request.input, str):
            return original(request)
        messages = original(request.model_copy(update={"input": []}))  # the previous response, instructions
        alone = {"previous_response_id": None, "instructions": None}
        for i, item in enumerate(request.input):
            message = media_message(item, i)
            if message is not None:
                messages.append(message)
                continue
            if isinstance(item, dict) and not item.get("type") and "role" in item:
                item = {**item, "type": "message"}  # EasyInputMessage: a message without its type
            messages.extend(original(request.model_copy(update={"input": [item], **alone})))
        if not messages:
            _reject("input has no message this server can read (message items with input_text or input_image parts)")
        return messages

    return to_chat_messages


def media_in_messages(server: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """The host's Responses preparation pulls the images out of the messages (its text-model way);
    an mlx-vlm model needs them in place, as its chat handler keeps them (``_prepare_chat_messages``)."""

    @functools.wraps(original)
    def prepare(request: Any, *args: Any, **kwargs: Any) -> Any:
        engine, chat_request, messages, chat_kwargs = original(request, *args, **kwargs)
        if getattr(engine, "is_mllm", False) and (chat_kwargs.get("images") or chat_kwargs.get("videos")):
            messages = server._prepare_chat_messages(engine, chat_request.messages)[0]
            chat_kwargs.pop("images", None)
            chat_kwargs.pop("videos", None)
        return engine, chat_request, messages, chat_kwargs

    return prepare


def refusing_invalid(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The host's Responses-to-chat conversion, with what its chat request model refuses (a tool's function name,
    say) a 400 naming the field: the Responses request model lets it through, and the host answered 500."""

    @functools.wraps(original)
    def to_chat_request(request: Any) -> Any:
        from pydantic import ValidationError

        try:
            return original(request)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            _reject("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors[:3])
                    + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""))
            raise

    return to_chat_request


def install(server: Any) -> None:
    """Replace the host's converters and preparation (vllm-mlx 0.6.0; the Responses handler looks them up at
    call time)."""
    if getattr(server, "_responses_media_installed", False):
        return
    server._responses_media_installed = True
    server._responses_input_to_chat_messages = with_media(server._responses_input_to_chat_messages)
    server._prepare_responses_request = media_in_messages(server, server._prepare_responses_request)
    server._responses_request_to_chat_request = refusing_invalid(server._responses_request_to_chat_request)
