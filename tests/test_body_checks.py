"""The checks the middleware runs on a body before the host's handler (no server): what is not a JSON object the
handlers can read, and what they would trip over, is a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from vllm_mlx_mtp_routing.host import body_checks, request_body
from vllm_mlx_mtp_routing.plugin_api.errors import RequestRejected

MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
ANTHROPIC = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


def refused(fn: Callable[..., Any], *args: Any) -> str:
    with pytest.raises(RequestRejected) as info:
        fn(*args)
    assert info.value.status_code == 400
    return info.value.message


def test_a_body_that_is_not_a_json_object_is_refused() -> None:
    assert request_body.parse(b"") == {}
    assert request_body.parse(b'{"a": [1, {"b": "c"}], "e": "\\ud83d\\ude00"}') == {"a": [1, {"b": "c"}], "e": "\U0001f600"}
    assert request_body.parse(b"x" * (request_body.MAX_BYTES + 1)) is None  # passed on unparsed, as before
    assert "not valid JSON" in refused(request_body.parse, b"{x")
    assert "not valid JSON" in refused(request_body.parse, b'{"a": "\xff"}')  # not UTF-8
    assert "must be a JSON object, got list" in refused(request_body.parse, b"[1]")
    assert "nested deeper than 64" in refused(request_body.parse, b"[" * 10_000 + b"]" * 10_000)  # json's own limit
    deep = json.dumps({"a": json.loads("[" * 70 + "]" * 70)}).encode()
    assert refused(request_body.parse, deep).startswith("request body: a[0][0]")
    request_body.parse(json.dumps({"a": json.loads("[" * 60 + "]" * 60)}).encode())


@pytest.mark.parametrize("raw,field", [
    (b'{"messages": [{"content": "x\\ud800"}]}', "messages[0].content"),
    ('{"prompt": "\udfff"}'.encode("utf-8", "surrogatepass"), "prompt"),  # a surrogate's UTF-8 bytes
    (b'{"\\udc00": 1}', "\\udc00"),
])
def test_a_lone_surrogate_anywhere_is_refused_naming_the_field(raw: bytes, field: str) -> None:
    message = refused(request_body.parse, raw)
    assert message.startswith(field) and "lone surrogate" in message


def test_anthropic_bodies_are_checked_as_the_host_reads_them() -> None:
    body_checks.check(MESSAGES, ANTHROPIC)
    body_checks.check(COUNT, {"model": "m", "messages": ANTHROPIC["messages"], "max_tokens": 0})  # a count takes none
    assert refused(body_checks.check, MESSAGES, {**ANTHROPIC, "max_tokens": None}).startswith("max_tokens")
    assert refused(body_checks.check, MESSAGES, {**ANTHROPIC, "messages": "hi"}).startswith("messages")
    assert refused(body_checks.check, COUNT, {"model": "m", "messages": [7]}).startswith("messages[0]")
    assert refused(body_checks.check, COUNT, {**ANTHROPIC, "tools": [1]}).startswith("tools[0]")
    for system in ([{"type": "text", "text": 5}], [{"type": "text"}], [{"junk": 1}], [{"type": "image"}]):
        for path in (MESSAGES, COUNT):
            assert refused(body_checks.check, path, {**ANTHROPIC, "system": system}).startswith("system")
    body_checks.check(MESSAGES, {**ANTHROPIC, "system": [{"type": "text", "text": "Be brief.", "cache_control": {}}]})


@pytest.mark.parametrize("block,field", [
    ({"type": "image"}, "messages[0].content[0]: an image block"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": 5}}, "messages[0].content[0].source"),
    ({"type": "image", "source": {"type": "base64", "media_type": 5, "data": "AAAA"}}, "messages[0].content[0].source"),
    ({"type": "image", "source": {"type": "url", "url": ""}}, "messages[0].content[0].source"),
    ({"type": "image", "source": {"type": "file"}}, "messages[0].content[0].source.type"),
    ({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": None}]}, "messages[0].content[0].content[0].text"),
    ({"text": "no type"}, "messages[0].content"),
])
def test_anthropic_content_blocks_missing_their_fields(block: dict[str, Any], field: str) -> None:
    assert refused(body_checks.check, MESSAGES, {**ANTHROPIC, "messages": [{"role": "user", "content": [block]}]}).startswith(field)


def test_chat_parts_completion_prompts_and_parameters() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    body_checks.check("/v1/chat/completions", chat)
    for part in ({"type": "text"}, {"type": "image_url"}, {"type": "image_url", "image_url": {"detail": "low"}}, "text", 3,
                 {"text": "no type"}, {"type": ["text"], "text": "hi"}):
        message = refused(body_checks.check, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [part]}]})
        assert message.startswith("messages[0].content[0]")
    body_checks.check("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:x"}]}]})
    for prompt in ("", [], [""], ["a", ""]):
        assert refused(body_checks.check, "/v1/completions", {"model": "m", "prompt": prompt}) == "prompt must not be empty"
    body_checks.check("/v1/completions", {"model": "m", "prompt": ["a", "b"]})
    for value in (0, False, -1, 1.5):
        assert refused(body_checks.check, "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": value}).startswith("max_output_tokens")
    for salt in ("", "s" * 257, 5, True, ["a"]):
        assert refused(body_checks.check, "/v1/responses", {"model": "m", "input": "hi", "cache_salt": salt}).startswith("cache_salt")
    body_checks.check("/v1/chat/completions", {**chat, "cache_salt": "s" * 256, "temperature": 0.5})
    assert refused(body_checks.check, MESSAGES, {**ANTHROPIC, "temperature": -1}).startswith("temperature")


@pytest.mark.parametrize("item,field", [
    ({"role": {}, "content": "hi"}, "input[0].role"),
    ({"type": "message", "role": None, "content": "hi"}, "input[0].role"),
    ({"role": "user", "content": 5}, "input[0].content"),
    ({"role": "user", "content": [{"type": "output_text", "text": 5}]}, "input[0].content[0].text"),
    ({"type": "function_call", "call_id": "c", "name": 3, "arguments": "{}"}, "input[0].name"),
    ({"type": "function_call_output", "call_id": "c", "output": {"x": 1}}, "input[0].output"),
    ({"type": "reasoning", "content": 7}, "input[0].content"),
    ({"type": "reasoning", "content": [{"type": "reasoning_text", "text": None}]}, "input[0].content[0].text"),
    ({"type": "message", "role": "user", "content": [{"type": [None], "text": "0"}]}, "input[0].content[0].type"),
])
def test_responses_items_the_host_would_convert_blindly(item: dict[str, Any], field: str) -> None:
    body = {"model": "m", "input": [{"role": "user", "content": "hi"}]}
    body_checks.check("/v1/responses", body)
    assert refused(body_checks.check, "/v1/responses", {**body, "input": [item]}).startswith(field)


@pytest.mark.parametrize("raw,field", [
    (b'{"input": [Infinity, false]}', "input[0]"),
    (b'{"messages": [{"content": {"a": NaN}}]}', "messages[0].content.a"),
    (b'{"temperature": -1e999}', "temperature"),
])
def test_a_number_json_has_not_is_refused(raw: bytes, field: str) -> None:
    """The host's own 422 echoes the value, and its JSON response cannot write a NaN: a 500."""
    message = refused(request_body.parse, raw)
    assert message.startswith(field) and "not a JSON number" in message
