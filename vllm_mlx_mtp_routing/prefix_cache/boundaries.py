"""Where a chat prompt is worth a snapshot: found by rendering the chat template, not by guessing.

- the end of the system + tools block: the template rendered with the system messages (and the
  request's tools) and two different one-message user turns; where the two renderings part is
  where the first user turn's content starts (the host's warm-up finds its prefix the same way);
- the start of the last user or tool message's content: the conversation rendered with that
  message's content replaced by two different probes;
- the end of the conversation as the next turn will render it: the prompt and the conversation
  rendered with one more assistant reply and a user message (and, separately, a tool result) part
  where the template's generation prompt stops being what a later turn repeats (Qwen3.5 opens a
  ``<think>`` block there that the re-rendered history drops, and drops the think blocks of the
  replies since the last user message once a new user message follows).

A rendering's common prefix is turned into a token position by encoding it and keeping only the
tokens that the real prompt shares (BPE may merge across the cut; the position is always a true
prefix of the prompt's own tokens). The end of the prompt needs no rendering (the engine adds it).
``shared_tokens`` (``SharedTokens``) gives that count without encoding the whole prefix again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from .shared_tokens import common_prefix_len

logger = logging.getLogger("vllm_mlx_mtp_routing.prefix_cache")

_PROBES = ("Alpha", "Bravo")  # differ at their first character (see vllm_mlx.prompt_warmup)
MIN_POSITION = 16  # a shorter prefix is not worth a snapshot's fixed gated-delta state


def _common_prefix(a: str, b: str) -> str:
    return a[: common_prefix_len(a, b)]


def common_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    return common_prefix_len(a, b)


def _probe_prefix(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]], index: int) -> str | None:
    outs = []
    for probe in _PROBES:
        probed = [dict(m) for m in messages]
        probed[index] = {**probed[index], "content": probe}
        outs.append(render(probed))
    prefix = _common_prefix(*outs)
    return prefix if prefix and prefix != outs[0] else None


def snapshot_positions(
    render: Callable[[list[dict[str, Any]]], str],
    encode: Callable[[str], list[int]],
    messages: list[dict[str, Any]],
    prompt: str,
    prompt_ids: Sequence[int],
    shared_tokens: Callable[[str], int] | None = None,
) -> list[tuple[int, str]]:
    """[(position, kind)] for a chat's prompt tokens; ``render`` applies the request's template
    (tools and template options included) to a message list; ``shared_tokens(text)``, when given,
    equals ``common_tokens(encode(text), prompt_ids)``. Errors mean no positions."""
    out: list[tuple[int, str]] = []
    shared = shared_tokens or (lambda text: common_tokens(encode(text), prompt_ids))
    try:
        system = [m for m in messages if m.get("role") == "system"]
        if len(messages) > len(system):  # a prompt that is all system has only its end to keep
            prefix = _probe_prefix(render, [*system, {"role": "user", "content": ""}], len(system))
            if prefix is not None:
                out.append((shared(prefix), "system"))
        last = max((i for i, m in enumerate(messages) if m.get("role") in ("user", "tool")), default=None)
        if last is not None and last > len(system):
            prefix = _probe_prefix(render, messages, last)
            if prefix is not None:
                out.append((shared(prefix), "message"))
        # The next turn adds a reply and then a user message or a tool result; Qwen3.5 renders the
        # replies since the last user message with their think blocks until a user message follows.
        for follow in ("user", "tool"):
            nxt = render([*messages, {"role": "assistant", "content": _PROBES[0]}, {"role": follow, "content": _PROBES[1]}])
            prefix = _common_prefix(prompt, nxt)
            if prefix and prefix != prompt:
                out.append((shared(prefix), "prompt"))
    except Exception as exc:  # a template that cannot render a probe: no mid-prompt snapshots
        logger.debug("prefix cache: no snapshot positions (%s: %s)", type(exc).__name__, exc)
        return []
    # One kind per position, the one kept longest (each kind serves other requests: the system
    # block other conversations, the end of the turn this conversation's next one).
    rank = {"prompt": 0, "message": 1, "system": 2}
    kept: dict[int, str] = {}
    for pos, kind in out:
        if MIN_POSITION <= pos < len(prompt_ids) - 1 and rank[kind] >= rank.get(kept.get(pos, "prompt"), 0):
            kept[pos] = kind
    return sorted(kept.items())
