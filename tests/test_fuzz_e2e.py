"""A bounded fuzz run through the real server: request bodies generated from a small schema of each generation
endpoint (chat, completions, messages, count_tokens, responses), with the served model's name, mostly valid values
and now and then any JSON value in a field's place (wrong types, nulls, nesting, lone surrogates, huge numbers).
Fixed seed, a few dozen cases per operation; no answer may be a 5xx, a stream may carry no server-error frame, and
every counter is back at 0 afterwards.

Generated with Hypothesis from this module's own schema: the host's OpenAPI document has no body schema for the
Anthropic endpoints (their handlers read the raw request).
"""

from __future__ import annotations

import base64
import io
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st

from support.plugin_status import SHARED_FLAGS, wait_idle
from support.server import Server

pytestmark = [pytest.mark.server, pytest.mark.fuzz]

SEED = 20261127
CASES = 40  # per operation
# What a stream's error frame says for a 5xx (vllm-mlx 0.6.0: its OpenAI and Anthropic SSE error frames).
SERVER_ERROR_FRAMES = ("Internal server error", "InternalServerError", '"api_error"')


@pytest.fixture(scope="module")
def server(tiny_vlm_bf16: Path, shared_server: Callable[..., Server]) -> Server:
    return shared_server(tiny_vlm_bf16, *SHARED_FLAGS)


def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 40, 40)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


PNG = _png()

LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8),
    st.sampled_from(["\ud800", "a\udfffb", "", " " * 3, "0", "-1", "1e999"]),
)
ANY = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                   max_leaves=8)
NOT_NULL = ANY.filter(lambda v: v is not None)  # a null max_tokens would mean the server's default: long generations
TEXT = st.one_of(st.text(min_size=1, max_size=24), st.sampled_from(["hello", "def f():", "", "\x00", "<|im_start|>", "\ud83d"]))


def maybe(valid: st.SearchStrategy[Any], junk: st.SearchStrategy[Any] = ANY) -> st.SearchStrategy[Any]:
    """A valid value, one time in ten any JSON value in its place (a body has a dozen fields: about a third of the
    bodies are valid throughout, and reach the engine)."""
    # Not k == 0: Hypothesis draws the simplest choice (0) far more often than the others.
    return st.integers(0, 19).flatmap(lambda k: junk if k in (3, 11) else valid)


def body(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(required, optional=optional)


def sampling() -> dict[str, st.SearchStrategy[Any]]:
    return {
        "temperature": maybe(st.floats(0, 2)), "top_p": maybe(st.floats(0, 1)), "top_k": maybe(st.integers(0, 50)),
        "min_p": maybe(st.floats(0, 1)), "seed": maybe(st.integers(0, 2**64)), "stream": maybe(st.booleans()),
        "presence_penalty": maybe(st.floats(-2, 2)), "repetition_penalty": maybe(st.floats(0.5, 2)),
        "cache_salt": maybe(TEXT),
    }


def max_tokens() -> st.SearchStrategy[Any]:
    return maybe(st.integers(1, 4), NOT_NULL)


def chat_body(model: str) -> st.SearchStrategy[dict[str, Any]]:
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": maybe(TEXT)}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": maybe(st.fixed_dictionaries(
            {"url": st.sampled_from([f"data:image/png;base64,{PNG}", "data:image/png;base64,AAAA", ""])}))}),
        ANY,
    )
    message = st.fixed_dictionaries({
        "role": maybe(st.sampled_from(["user", "assistant", "system", "developer", "tool"])),
        "content": maybe(TEXT | st.lists(part, min_size=1, max_size=3)),
    })
    tool = st.just({"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}})
    return body({"model": maybe(st.just(model)), "messages": maybe(st.lists(message, min_size=1, max_size=3)),
                 "max_tokens": max_tokens()},
                {**sampling(), "stop": maybe(TEXT | st.lists(TEXT, max_size=3)), "n": maybe(st.integers(1, 3)),
                 "logprobs": maybe(st.booleans()), "top_logprobs": maybe(st.integers(0, 5)),
                 "frequency_penalty": maybe(st.floats(-2, 2)), "tools": maybe(st.lists(tool, max_size=1)),
                 "logit_bias": maybe(st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=2))})


def completion_body(model: str) -> st.SearchStrategy[dict[str, Any]]:
    return body({"model": maybe(st.just(model)), "prompt": maybe(TEXT | st.lists(TEXT, max_size=2)), "max_tokens": max_tokens()},
                {**sampling(), "stop": maybe(TEXT | st.lists(TEXT, max_size=3)), "n": maybe(st.integers(1, 3)),
                 "logprobs": maybe(st.integers(0, 5))})


def anthropic_blocks() -> st.SearchStrategy[Any]:
    text = st.fixed_dictionaries({"type": st.just("text"), "text": maybe(TEXT)})
    source = st.one_of(st.fixed_dictionaries({"type": st.just("base64"), "media_type": maybe(st.just("image/png")),
                                              "data": maybe(st.sampled_from([PNG, "AAAA", ""]))}),
                       st.fixed_dictionaries({"type": st.sampled_from(["url", "file"]), "url": maybe(st.just(""))}))
    return st.one_of(
        text,
        st.fixed_dictionaries({"type": st.just("image"), "source": maybe(source)}),
        st.fixed_dictionaries({"type": st.just("tool_use"), "id": maybe(TEXT), "name": maybe(TEXT),
                               "input": maybe(st.dictionaries(st.text(max_size=4), LEAF, max_size=2))}),
        st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": maybe(TEXT),
                               "content": maybe(TEXT | st.lists(text, max_size=2))}),
        ANY,
    )


def anthropic_fields() -> tuple[dict[str, Any], dict[str, Any]]:
    message = st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "assistant"])),
                                     "content": maybe(TEXT | st.lists(anthropic_blocks(), min_size=1, max_size=3))})
    system_block = st.fixed_dictionaries({"type": maybe(st.just("text")), "text": maybe(TEXT)})
    tool = st.fixed_dictionaries({"name": maybe(st.sampled_from(["lookup", "not a name!"])), "description": maybe(TEXT),
                                  "input_schema": maybe(st.just({"type": "object", "properties": {}}))})
    return ({"messages": maybe(st.lists(message, min_size=1, max_size=3))},
            {"system": maybe(TEXT | st.lists(system_block, max_size=2)), "tools": maybe(st.lists(tool, max_size=1)),
             "tool_choice": maybe(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])}))})


def messages_body(model: str) -> st.SearchStrategy[dict[str, Any]]:
    required, optional = anthropic_fields()
    return body({"model": maybe(st.just(model)), "max_tokens": max_tokens(), **required},
                {**optional, **sampling(), "stop_sequences": maybe(st.lists(TEXT, max_size=2)),
                 "metadata": maybe(st.dictionaries(st.text(max_size=4), LEAF, max_size=2))})


def count_tokens_body(model: str) -> st.SearchStrategy[dict[str, Any]]:
    required, optional = anthropic_fields()
    return body({"model": maybe(st.just(model)), **required}, optional)


def responses_body(model: str) -> st.SearchStrategy[dict[str, Any]]:
    part = st.fixed_dictionaries({"type": maybe(st.sampled_from(["input_text", "output_text", "input_image"])), "text": maybe(TEXT)})
    item = st.one_of(
        st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "assistant", "developer", "system"])),
                               "content": maybe(TEXT | st.lists(part, min_size=1, max_size=2))}),
        st.fixed_dictionaries({"type": st.just("message"), "role": maybe(st.just("user")),
                               "content": maybe(st.lists(part, min_size=1, max_size=2))}),
        ANY,
    )
    sampled = {k: v for k, v in sampling().items() if k in ("temperature", "top_p", "stream", "cache_salt")}
    return body({"model": maybe(st.just(model)), "input": maybe(TEXT | st.lists(item, min_size=1, max_size=3)),
                 "max_output_tokens": max_tokens()},
                {**sampled, "instructions": maybe(TEXT)})


OPERATIONS: dict[str, Callable[[str], st.SearchStrategy[dict[str, Any]]]] = {
    "/v1/chat/completions": chat_body, "/v1/completions": completion_body, "/v1/messages": messages_body,
    "/v1/messages/count_tokens": count_tokens_body, "/v1/responses": responses_body,
}


@pytest.mark.parametrize("path", list(OPERATIONS))
def test_fuzzed_bodies_never_get_a_5xx(server: Server, path: str) -> None:
    statuses: Counter[int] = Counter()
    with server.client(timeout=120) as client:

        @seed(SEED)
        @settings(max_examples=CASES, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(payload=OPERATIONS[path](server.model))
        def one(payload: dict[str, Any]) -> None:
            raw = json.dumps(payload).encode()  # NaN and lone surrogates as Python writes them (escaped)
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            statuses[r.status_code] += 1
            assert r.status_code < 500, f"{r.status_code} for {raw[:2000]!r}: {r.text[:1000]}"
            frames = [f for f in SERVER_ERROR_FRAMES if f in r.text]
            assert not frames, f"a server error in the stream for {raw[:2000]!r}: {r.text[-1000:]}"

        try:
            one()
        except httpx.HTTPError as exc:  # the server went away: its log says why
            raise AssertionError(f"{exc!r}; server log:\n{server.log()[-4000:]}") from exc
    assert sum(statuses.values()) >= CASES // 2, statuses  # Hypothesis may stop early, never at a handful
    assert statuses[200] > 0, statuses  # valid bodies were among them
    wait_idle(server, within=10.0)
    ok = server.post(path, json=OPERATIONS_OK[path](server.model), timeout=60)
    assert ok.status_code == 200, ok.text


OPERATIONS_OK: dict[str, Callable[[str], dict[str, Any]]] = {
    "/v1/chat/completions": lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": lambda m: {"model": m, "prompt": "hi", "max_tokens": 2},
    "/v1/messages": lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/messages/count_tokens": lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": lambda m: {"model": m, "input": "hi", "max_output_tokens": 2},
}
