"""Chat message normalization applied before the chat template, on the text and media paths.

Qwen3.5's template raises "System message must be at the beginning." for any system message
that is not first, and agents (Claude Code, Codex) send such messages mid-conversation and as
`developer`. So: `developer` becomes `system`; every system message is hoisted to position 0
and merged, in order, into one; then consecutive messages of the same role are merged where
that loses nothing. Kept apart: `tool` results (the template groups them itself and each
answers its own call), assistant turns that carry `tool_calls`, and messages that differ in
any key other than `content` (a `name`, a `reasoning_content`, ...).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

ROLE_ALIASES = {"developer": "system"}
MERGEABLE_ROLES = frozenset({"user", "assistant"})
SEPARATOR = "\n\n"


def _copy(message: Mapping[str, Any]) -> dict[str, Any]:
    # Deep, so that later in-place edits (the host rewrites tool-call arguments in place)
    # never reach the caller's objects; strings, the bulk of a request, are not duplicated.
    out = copy.deepcopy(dict(message))
    role = out.get("role")
    if role in ROLE_ALIASES:
        out["role"] = ROLE_ALIASES[role]
    return out


def _is_empty(content: Any) -> bool:
    return content is None or content == "" or content == []


def _as_parts(content: str | list) -> list:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _join(a: Any, b: Any) -> Any:
    """Contents of two merged messages: strings joined by a blank line, else one part list."""
    if _is_empty(b):
        return a
    if _is_empty(a):
        return b
    if isinstance(a, str) and isinstance(b, str):
        return a + SEPARATOR + b
    # The same blank line as a text part, so the texts of two turns do not run together.
    return _as_parts(a) + [{"type": "text", "text": SEPARATOR}] + _as_parts(b)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    merged = {**b, **a}  # a's keys (and key order) win; b only adds keys a lacks
    merged["content"] = _join(a.get("content"), b.get("content"))
    return merged


def _extras(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}


def _mergeable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a.get("role") == b.get("role")
        and a.get("role") in MERGEABLE_ROLES
        and not a.get("tool_calls")
        and not b.get("tool_calls")
        and all(isinstance(m.get("content"), (str, list, type(None))) for m in (a, b))
        and _extras(a) == _extras(b)
    )


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Return new messages the Qwen3.5 template accepts; `messages` is left untouched.

    `developer` -> `system`; all system messages hoisted to the front and merged in order
    (always, whatever their other keys: the template takes one); then consecutive
    `user`/`assistant` messages merged unless either carries `tool_calls` or their other
    keys differ. String contents are joined with a blank line; when a list (multimodal
    parts) is involved, the result is one list, a string becoming a text part and a "\\n\\n"
    text part separating the two.
    """
    copies = [_copy(m) for m in messages]
    systems = [m for m in copies if m.get("role") == "system"]
    out: list[dict] = []
    if systems:
        head = systems[0]
        for m in systems[1:]:
            head = _merge(head, m)
        out.append(head)
    for m in copies:
        if m.get("role") == "system":
            continue
        if out and _mergeable(out[-1], m):
            out[-1] = _merge(out[-1], m)
        else:
            out.append(m)
    if len(out) != len(messages) or (systems and copies[0].get("role") != "system"):
        logger.debug("normalized %d messages into %d (%d system)", len(messages), len(out), len(systems))
    return out
