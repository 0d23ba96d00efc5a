"""The pure parts of n choices, request aliases and host-path stop strings (no model, no server)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from vllm_mlx_mtp_routing.host import choices, request_body
from vllm_mlx_mtp_routing.plugin_api.errors import RequestRejected
from vllm_mlx_mtp_routing.routing.stop_strings import StopCut, cut


@pytest.mark.parametrize("n, ok", [(None, 1), (1, 1), (3, 3), (2.0, 2), (0, None), (17, None), ("2", None), (True, None)])
def test_requested(n, ok) -> None:
    body = {} if n is None else {"n": n}
    if ok is None:
        with pytest.raises(RequestRejected, match="n must be"):
            choices.requested("/v1/chat/completions", body)
    else:
        assert choices.requested("/v1/chat/completions", body) == ok
    assert choices.requested("/v1/messages", {"n": 0}) == 1  # not an OpenAI choices endpoint


def test_copy_body_seeds_and_drops_n() -> None:
    body = {"n": 3, "seed": 2**64 - 1, "model": "m"}
    assert [choices.copy_body(body, j) for j in range(2)] == [{"seed": 2**64 - 1, "model": "m"}, {"seed": 0, "model": "m"}]
    assert choices.copy_body({"n": 2, "seed": "x"}, 1) == {"seed": "x"}  # invalid: left for the parameter check


def test_merged_usage_counts_the_prompt_once() -> None:
    u = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 8}}
    merged = choices.merged_usage([u, {**u, "completion_tokens": 6}, None])
    assert merged == {"prompt_tokens": 9, "completion_tokens": 10, "total_tokens": 19, "prompt_tokens_details": {"cached_tokens": 8}}
    assert choices.merged_usage([None]) is None


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def test_stream_merge_renumbers_splits_and_ends_once() -> None:
    class Parent:
        response_id = None

    def chunk(cid, text, finish=None, usage=None):
        return {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}], "usage": usage}

    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    events: asyncio.Queue = asyncio.Queue()
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    a = _sse(chunk("a", "x")) + _sse(chunk("a", "y", "length", usage)) + b"data: [DONE]\n\n"
    b = _sse(chunk("b", "p")) + _sse(chunk("b", "q", "length", usage)) + b"data: [DONE]\n\n"
    for j, _raw in ((0, a), (1, b)):
        events.put_nowait((j, "http.response.start", start))
    # copy 1's bytes arrive split inside an event
    for j, part in ((1, b[:30]), (0, a), (1, b[30:])):
        events.put_nowait((j, "http.response.body", {"type": "http.response.body", "body": part, "more_body": True}))
    events.put_nowait((0, "ended", None))
    events.put_nowait((1, "ended", None))
    sent = []

    async def send(m):
        sent.append(m)

    asyncio.run(choices._StreamMerge(2, events, send, Parent()).run())
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    frames = [f[6:] for f in body.split("\n\n") if f]
    assert frames[-1] == "[DONE]" and body.count("[DONE]") == 1
    objs = [json.loads(f) for f in frames[:-1]]
    assert {o["id"] for o in objs} == {objs[0]["id"]}
    text = {0: "", 1: ""}
    for o in objs:
        for c in o["choices"]:
            text[c["index"]] += c["delta"]["content"]
    assert text == {0: "xy", 1: "pq"}
    assert objs[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}  # the last finish
    assert all(o["usage"] is None for o in objs[:-1])


def test_a_refused_copy_is_the_response() -> None:
    class Parent:
        response_id = None

    events: asyncio.Queue = asyncio.Queue()
    events.put_nowait((1, "http.response.start", {"status": 400, "headers": [(b"content-type", b"application/json")]}))
    events.put_nowait((1, "http.response.body", {"body": b'{"error": 1}'}))
    events.put_nowait((1, "ended", None))
    sent = []

    async def send(m):
        sent.append(m)

    asyncio.run(choices._StreamMerge(2, events, send, Parent()).run())
    assert sent[0]["status"] == 400 and sent[1]["body"] == b'{"error": 1}'


def test_max_completion_tokens_fills_max_tokens() -> None:
    body = {"max_tokens": 50, "max_completion_tokens": 5}
    assert request_body.fill_aliases(body) and body["max_tokens"] == 5
    for bad in (0, -1, "5", True, None):
        body = {"max_completion_tokens": bad}
        assert not request_body.fill_aliases(body) and "max_tokens" not in body
    body = {"stop": "END"}
    assert request_body.fill_aliases(body) and body == {"stop": ["END"]}


def test_a_null_stream_is_not_streamed() -> None:
    body = {"input": "hi", "stream": None}  # what sglang-router 0.3.2 forwards for a Responses request
    assert request_body.drop_null_stream(body) and body == {"input": "hi"}
    for kept in ({"stream": False}, {"stream": True}, {}):
        assert not request_body.drop_null_stream(dict(kept))


def test_stop_cut_across_deltas() -> None:
    s = StopCut(["END", "xyz"])
    released = [s.feed(d, False) for d in ("abc E", "N", "D tail")]
    assert "".join(released) == "abc " and s.hit and s.text == "abc "
    s = StopCut(["END"])
    assert s.feed("abc EN", False) == "abc " and s.feed("", True) == "EN" and not s.hit


def test_cut_ends_the_host_stream_at_the_stop() -> None:
    @dataclass
    class Out:
        text: str
        new_text: str
        finished: bool = False
        finish_reason: str | None = None

    closed = []

    async def host():
        try:
            for t in ("he", "llo wo", "rld"):
                yield Out(t, t)
        finally:
            closed.append(True)

    async def collect():
        return [o async for o in cut(host(), ["o w"])]

    outs = asyncio.run(collect())
    assert "".join(o.new_text for o in outs) == "hell" and outs[-1].finish_reason == "stop" and outs[-1].finished
    assert closed == [True]

    async def untouched():
        return [o async for o in cut(host(), [])]

    assert [o.new_text for o in asyncio.run(untouched())] == ["he", "llo wo", "rld"]
