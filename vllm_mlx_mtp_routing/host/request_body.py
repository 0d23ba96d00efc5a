"""A generation request's body, read before the host's handler: kept as JSON for the plugin's hooks,
replayed unchanged to the handler, or with the OpenAI aliases vllm-mlx 0.6.0 does not know filled in.

A body that is not a JSON object the handlers can read is a 400 here: vllm-mlx 0.6.0's Anthropic handlers
parse the body themselves and answer 500 for invalid JSON, text holding a lone surrogate (a JSON
``\\ud800`` escape, or its UTF-8 bytes, which ``json.loads`` lets through) breaks the tokenizer, and a NaN or
an infinity (``NaN``, ``Infinity``, ``1e999``: ``json.loads`` reads them, JSON has none) turns the host's own
422 into a 500 (its error body echoes the value, which its JSON response cannot write).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..plugin_api.errors import RequestRejected

MAX_BYTES = 64 * 2**20  # a larger body is passed on but not parsed (the hooks see an empty body)
# Deeper than any request schema goes; deep enough bodies overflow the stack of whatever walks them recursively
# (json, copy.deepcopy, pydantic, a chat template).
MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read(receive: Any) -> bytes:
    """The whole body (a client that disconnects mid-body leaves what came)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def parse(raw: bytes) -> dict[str, Any] | None:
    """The JSON object (an empty body reads as ``{}``), or None for one over MAX_BYTES (the host answers it).
    RequestRejected(400) for a body that is not one: not JSON, not UTF-8 text, not an object, nested deeper
    than MAX_DEPTH, or a string holding a lone surrogate."""
    if len(raw) > MAX_BYTES:
        return None
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise RequestRejected(400, f"request body: JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise RequestRejected(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestRejected(400, f"request body must be a JSON object, got {type(body).__name__}")
    check_text(body)
    return body


def check_text(body: dict[str, Any]) -> None:
    """RequestRejected(400) naming the field: nesting deeper than MAX_DEPTH, a lone surrogate in a key or a
    string, a number that is not finite. Walked without recursion (a deep body is what it refuses)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH and isinstance(value, (dict, list)):
            raise RequestRejected(400, f"request body: {where} is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                field = f"{where}.{key}" if where else str(key)
                _check_string(field, key)
                stack.append((item, field, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise RequestRejected(400, f"{where or 'request body'}: {value} is not a JSON number")
        else:
            _check_string(where, value)


def _check_string(field: str, value: Any) -> None:
    if isinstance(value, str) and (match := _SURROGATE.search(value)) is not None:
        field = field.encode("utf-8", "backslashreplace").decode()  # the name itself may hold one
        raise RequestRejected(400, f"{field}: a lone surrogate (U+{ord(match.group()):04X}) is not valid Unicode text")


def fill_aliases(body: dict[str, Any]) -> bool:
    """``max_completion_tokens`` (OpenAI's name since max_tokens was deprecated) becomes ``max_tokens``,
    which the host reads; it wins over ``max_tokens`` as in vLLM. ``stop`` given as one string (OpenAI
    allows it; the host's model wants a list: 422) becomes a list. An invalid value is left for the
    parameter check to name. True when the body changed."""
    changed = False
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
        changed = True
    value = body.get("max_completion_tokens")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or body.get("max_tokens") == value:
        return changed
    body["max_tokens"] = value
    return True


def drop_null_stream(body: dict[str, Any]) -> bool:
    """``"stream": null`` is the default, not streamed (the host's models refuse a null there: 422). sglang-router 0.3.2
    writes it into every Responses request that did not ask for a stream. True when the body changed."""
    if "stream" in body and body["stream"] is None:
        del body["stream"]
        return True
    return False


def replay(raw: bytes, receive: Any) -> Any:
    """A receive that gives ``raw`` as the body once, then the client's own messages (disconnects)."""
    sent = False

    async def receive_again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return receive_again
