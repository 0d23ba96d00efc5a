"""A generation request's body, read before the host's handler: kept as JSON for the plugin's hooks,
replayed unchanged to the handler, or with the OpenAI aliases vllm-mlx 0.6.0 does not know filled in."""

from __future__ import annotations

import json
from typing import Any

MAX_BYTES = 64 * 2**20  # a larger body is passed on but not parsed (the hooks see an empty body)


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
    """The JSON object, or None (malformed, not an object, too large: the host answers those itself)."""
    if len(raw) > MAX_BYTES:
        return None
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


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
