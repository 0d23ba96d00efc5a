"""``logprobs`` in the host's OpenAI responses (vllm-mlx 0.6.0 internals: ``vllm_mlx.api.models``, the
streamed ``/v1/completions`` chunks that ``server`` writes as plain JSON).

The host has no logprobs anywhere: its ``GenerationOutput`` carries none and its choice models have
no field for them. The text path records each output's entries on the request's context
(``record``), per choice index; the host's choice models gain a ``logprobs`` field whose default
reads them when the host builds a choice: a chat choice gets ``{"content": [...]}`` (OpenAI chat
shape), a completion choice ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (the
legacy shape). A streamed choice takes the entries recorded since the previous chunk, so every
token is reported once, in order, even where the host's parsers hold text back. Streamed
completions are plain JSON in the host, so their chunks are amended on the way out
(``amend_sse``). A final stop token (EOS) is not reported, as its text is not in the content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from . import asgi


@dataclass
class _Choice:
    entries: list[tuple[str, float, list[tuple[str, float]]]] = field(default_factory=list)
    taken: int = 0  # entries already attached to a response

    def take(self) -> list[tuple[str, float, list[tuple[str, float]]]]:
        new, self.taken = self.entries[self.taken :], len(self.entries)
        return new


def record(tokenizer: Any, out: Any, index: int = 0) -> None:
    """Add a text-engine output's logprob entries to the current request's choice ``index``."""
    ctx = asgi.current()
    if ctx is None or out.logprobs is None:
        return
    store: dict[int, _Choice] | None = getattr(ctx, "logprobs", None)
    if store is None:
        store = ctx.logprobs = {}
        ctx.body_filters.append(amend_sse)
    choice = store.setdefault(index, _Choice())
    entries = list(out.logprobs)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    if out.finished and out.finish_reason == "stop" and entries and entries[-1].token in special:
        entries.pop()
    text = lambda t: tokenizer.decode([t])  # noqa: E731
    choice.entries += [(text(e.token), e.logprob, [(text(t), lp) for t, lp in e.top]) for e in entries]


def _take(index: int) -> list[tuple[str, float, list[tuple[str, float]]]] | None:
    store = getattr(asgi.current(), "logprobs", None)
    if not store:
        return None
    # A prompt list in /v1/completions runs one engine call per prompt, each recorded as index 0,
    # and the host numbers the choices itself.
    choice = store.get(index) or store.get(0)
    return choice.take() if choice is not None else None


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [{**_token(t, lp), "top_logprobs": [_token(a, alp) for a, alp in top]} for t, lp, top in entries]}


def completion_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    offsets, at = [], 0
    for t, _, _ in entries:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{a: alp for a, alp in top} | {t: lp} for t, lp, top in entries],
        "text_offset": offsets,
    }


def _chat_default(data: dict[str, Any]) -> dict[str, Any] | None:
    return chat_logprobs(_take(int(data.get("index") or 0)))


def _completion_default(data: dict[str, Any]) -> dict[str, Any] | None:
    return completion_logprobs(_take(int(data.get("index") or 0)))


def amend_sse(message: dict[str, Any]) -> dict[str, Any]:
    """A streamed ``text_completion`` chunk with its choice's entries recorded since the last chunk."""
    body = message.get("body", b"")
    if message.get("type") != "http.response.body" or b'"text_completion"' not in body:
        return message
    events = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            data = json.loads(event[6:])
            for choice in data.get("choices") or ():
                choice["logprobs"] = completion_logprobs(_take(int(choice.get("index") or 0)))
            event = b"data: " + json.dumps(data).encode()
        events.append(event)
    return {**message, "body": b"\n\n".join(events)}


_installed = False


def install() -> None:
    """Add the ``logprobs`` fields to the host's choice models (idempotent)."""
    global _installed
    if _installed:
        return
    from vllm_mlx.api import models

    for cls, default in (
        (models.ChatCompletionChoice, _chat_default),
        (models.ChatCompletionChunkChoice, _chat_default),
        (models.CompletionChoice, _completion_default),
    ):
        cls.model_fields["logprobs"] = FieldInfo(annotation=Optional[dict], default_factory=default)  # noqa: UP045 - a value pydantic reads at run time, left as it was
        cls.model_rebuild(force=True)
    for value in vars(models).values():
        if isinstance(value, type) and issubclass(value, BaseModel) and any(
            "Choice" in str(f.annotation) for f in value.model_fields.values()
        ):
            value.model_rebuild(force=True)
    _installed = True
