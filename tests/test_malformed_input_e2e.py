"""Malformed input through the real server: a 400 naming the field on every endpoint, never a 500.

vllm-mlx 0.6.0's handlers answer 500 where a body breaks their assumptions (the Anthropic endpoints parse it
themselves, /v1/responses builds a chat request its own model refuses); the plugin's middleware answers these
first. Each test ends with the counters at 0 and the server still serving.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from support.plugin_status import SHARED_FLAGS, wait_idle
from support.server import Server

pytestmark = pytest.mark.server

CHAT, COMPLETIONS, MESSAGES, COUNT, RESPONSES = (
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
)


@pytest.fixture(scope="module")
def server(tiny_vlm_bf16: Path, shared_server: Callable[..., Server]) -> Server:
    return shared_server(tiny_vlm_bf16, *SHARED_FLAGS)


def chat(server: Server, **kw: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **kw}


def anthropic(server: Server, **kw: Any) -> dict[str, Any]:
    return {"model": server.model, "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}], **kw}


def assert_refused(server: Server, path: str, field: str, *, content: bytes | None = None, **body: Any) -> None:
    """A 400 (or the host's own 422) naming ``field``, streamed or not; then the counters are 0 and the server serves."""
    for stream in (False, True) if content is None and path != COUNT else (False,):
        payload = content if content is not None else json.dumps({**body, "stream": True} if stream else body).encode()
        r = server.post(path, content=payload, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code in (400, 422), (path, body, r.status_code, r.text[:500])
        assert field in r.text, (field, r.text[:500])
    wait_idle(server, within=5.0)
    ok = server.post(CHAT, json=chat(server), timeout=60)
    assert ok.status_code == 200, ok.text


def test_anthropic_messages_validation_errors_are_400_naming_the_field(server: Server) -> None:
    body = anthropic(server)
    del body["max_tokens"]
    assert_refused(server, MESSAGES, "max_tokens", **body)
    assert_refused(server, MESSAGES, "messages", **anthropic(server, messages="hello"))
    assert_refused(server, MESSAGES, "messages[0].content", **anthropic(server, messages=[{"role": "user", "content": [{"text": "hi"}]}]))
    assert_refused(server, MESSAGES, "model", **{**anthropic(server), "model": 7})


@pytest.mark.parametrize("system", [[{"type": "text", "text": 5}], [{"type": "text", "text": None}], [{"junk": 1}], [{"type": "image"}]])
def test_anthropic_system_blocks_with_junk_are_400(server: Server, system: Any) -> None:
    assert_refused(server, MESSAGES, "system", **anthropic(server, system=system))
    assert_refused(server, COUNT, "system", **anthropic(server, system=system))


@pytest.mark.parametrize("block,field", [
    ({"type": "image"}, "image block"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": 5}}, "source"),
    ({"type": "image", "source": {"type": "url"}}, "url"),
    ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "source.type"),
    ({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": 3}]}, "content[0].text"),
    ({"type": "text", "text": {"a": 1}}, "messages[0].content"),
])
def test_anthropic_content_blocks_missing_their_fields_are_400(server: Server, block: dict, field: str) -> None:
    messages = [{"role": "user", "content": [block]}]
    assert_refused(server, MESSAGES, field, **anthropic(server, messages=messages))


def test_count_tokens_counts_valid_input_and_refuses_junk(server: Server) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model)
    system, question, answer = "You are terse.", "How many tokens is this?", "Some."
    body = {"model": server.model, "system": system, "messages": [
        {"role": "user", "content": question}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}
    r = server.post(COUNT, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"input_tokens": sum(len(tok.encode(t)) for t in (system, question, answer))}
    assert server.post(COUNT, json={**body, "max_tokens": 0}, timeout=30).status_code == 200  # a count takes no max_tokens
    nulls = server.post(COUNT, json={**body, "tools": None, "tool_choice": None, "metadata": None}, timeout=30)
    assert nulls.status_code == 200 and nulls.json() == r.json(), nulls.text  # optional fields given as null: unset
    assert_refused(server, COUNT, "messages", model=server.model, messages=5)
    assert_refused(server, COUNT, "messages[0]", model=server.model, messages=[7])
    assert_refused(server, COUNT, "tools[0]", **{**body, "tools": [1]})
    assert_refused(server, COUNT, "body", content=b"[1, 2]")


@pytest.mark.parametrize("prompt", ["", [], [""], ["a", ""]])
def test_empty_completion_prompts_are_400(server: Server, prompt: Any) -> None:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 3}
    assert_refused(server, COMPLETIONS, "prompt", **body)
    assert_refused(server, COMPLETIONS, "prompt", **body, stop="x")
    assert_refused(server, COMPLETIONS, "prompt", **body, stop=["x", "y"], n=2)


@pytest.mark.parametrize("value", [0, False, -1, 1.5, "many"])
def test_responses_max_output_tokens_out_of_range_is_400(server: Server, value: Any) -> None:
    body = {"model": server.model, "input": "hello", "max_output_tokens": value}
    assert_refused(server, RESPONSES, "max_output_tokens", **body)


@pytest.mark.parametrize("item,field", [
    ({"role": {}, "content": "hi"}, "input[0].role"),
    ({"role": "user", "content": [{"type": "output_text", "text": 5}]}, "input[0].content[0].text"),
    ({"type": "function_call_output", "call_id": "c", "output": {"x": 1}}, "input[0].output"),
    ({"type": "reasoning", "content": 7}, "input[0].content"),
])
def test_responses_input_items_the_host_would_trip_over_are_400(server: Server, item: dict, field: str) -> None:
    assert_refused(server, RESPONSES, field, model=server.model, input=[item], max_output_tokens=3)


def test_responses_tools_the_chat_request_refuses_are_400(server: Server) -> None:
    """The host builds a chat request from a Responses one; its validation of what it copies (a function name) was
    a 500 (found by the Schemathesis run, docs/robustness.md)."""
    tool = {"type": "function", "name": "not a name!", "parameters": {"type": "object", "properties": {}}}
    assert_refused(server, RESPONSES, "tools.0", model=server.model, input="hi", tools=[tool], max_output_tokens=3)


@pytest.mark.parametrize("url", ["\u00a8", "/tmp/picture.png"])
def test_image_references_that_are_no_url_are_400(server: Server, url: str) -> None:
    """Found by the Schemathesis run: an Anthropic url image source (or a chat image_url) that is neither an http(s)
    URL nor inline data was a 500 from the host's media path."""
    block = {"type": "image", "source": {"type": "url", "url": url}}
    assert_refused(server, MESSAGES, "http(s) URL", **anthropic(server, messages=[{"role": "user", "content": [block]}]))
    part = {"type": "image_url", "image_url": {"url": url}}
    assert_refused(server, CHAT, "http(s) URL", **chat(server, messages=[{"role": "user", "content": [part]}]))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES, COUNT, RESPONSES])
def test_bodies_that_are_not_json_objects_are_400_on_every_endpoint(server: Server, path: str) -> None:
    good = {CHAT: chat(server), COMPLETIONS: {"model": server.model, "prompt": "hi", "max_tokens": 3},
            MESSAGES: anthropic(server), COUNT: anthropic(server), RESPONSES: {"model": server.model, "input": "hi"}}[path]
    text = json.dumps(good)
    for raw, field in [
        (b"{not json", "not valid JSON"),
        (text.replace('"hi', '"\\ud800hi').replace('"hello', '"\\udfffhello').encode(), "surrogate"),  # JSON escapes
        (text.replace('"hi', '"\xedhi').replace('"hello', '"\xedhello').encode("latin-1"), "not valid JSON"),  # not UTF-8
        (text.replace('"hi', '"\ud800hi').replace('"hello', '"\ud800hello').encode("utf-8", "surrogatepass"), "surrogate"),
        (b"[" * 10_000 + b"]" * 10_000, "nested deeper"),
        (json.dumps({**good, "metadata": json.loads("[" * 100 + "]" * 100)}).encode(), "nested deeper"),
        (b'"hello"', "JSON object"),
        (json.dumps({**good, "extra": [float("nan")]}).encode(), "not a JSON number"),  # the host's 422 could not write it
    ]:
        assert_refused(server, path, field, content=raw)


@pytest.mark.parametrize("part,field", [
    ({"type": "text"}, "text part"),
    ({"type": "text", "text": 5}, "messages[0].content[0]"),
    ({"type": "image_url"}, "image_url"),
    ({"type": "image_url", "image_url": {"detail": "low"}}, "image_url"),
    ({"type": "video_url", "video_url": ""}, "video_url"),
    ("just text", "messages[0].content[0]"),
])
def test_chat_content_parts_missing_their_fields_are_400(server: Server, part: Any, field: str) -> None:
    assert_refused(server, CHAT, field, **chat(server, messages=[{"role": "user", "content": [part]}]))


def test_a_malformed_body_without_the_api_key_is_the_hosts_401(tiny_vlm_bf16: Path, tmp_path: Path) -> None:
    from support.server import serve

    with serve(tiny_vlm_bf16, *SHARED_FLAGS, "--api-key", "k", log_dir=tmp_path) as s:
        assert s.post(MESSAGES, content=b"{not json", timeout=30).status_code == 401
        r = s.post(MESSAGES, content=b"{not json", headers={"authorization": "Bearer k"}, timeout=30)
        assert r.status_code == 400 and "JSON" in r.text
