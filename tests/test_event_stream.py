"""Generation event streams on their way out (host/event_stream.py, asgi.HoldingSend, usage.amend_anthropic_sse):
keep-alives in each client's protocol, never a silent end, the usage the host leaves out of a streamed Anthropic
response. ASGI messages as the host writes them; no server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from vllm_mlx_mtp_routing.host import asgi, usage
from vllm_mlx_mtp_routing.host.event_stream import HEARTBEAT, PING, EventStream

Message = dict[str, Any]

START: Message = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]}
END: Message = {"type": "http.response.body", "body": b"", "more_body": False}


def body(data: bytes) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": True}


def anthropic_event(name: str, obj: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode()


MESSAGE_START = anthropic_event("message_start", {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 0, "output_tokens": 0}}})
MESSAGE_DELTA = anthropic_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                                  "usage": {"output_tokens": 7}})
MESSAGE_STOP = anthropic_event("message_stop", {"type": "message_stop"})


def events(sent: list[Message]) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) of every SSE event in the bodies sent; comments as ('comment', {})."""
    out = []
    for chunk in b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").split(b"\n\n"):
        if not chunk:
            continue
        if chunk.startswith(b":"):
            out.append(("comment", {}))
            continue
        fields = dict(line.split(": ", 1) for line in chunk.decode().split("\n"))
        data = fields["data"]
        out.append((fields.get("event", "data"), {} if data == "[DONE]" else json.loads(data)))
    return out


def test_heartbeats_become_anthropic_pings_and_stay_comments_for_openai() -> None:
    anthropic = EventStream("/v1/messages", {"timeout": 100})
    openai = EventStream("/v1/chat/completions", {"timeout": 100})
    assert anthropic.outgoing(body(HEARTBEAT)) == [body(PING)]
    assert openai.outgoing(body(HEARTBEAT)) == [body(HEARTBEAT)]
    # a stream that ends with its terminal frame ends as it is
    assert anthropic.outgoing(body(MESSAGE_STOP)) == [body(MESSAGE_STOP)] and anthropic.outgoing(END) == [END]
    assert openai.outgoing(body(b"data: [DONE]\n\n")) == [body(b"data: [DONE]\n\n")] and openai.outgoing(END) == [END]


def test_a_stream_the_host_timed_out_ends_with_an_error_and_its_terminal() -> None:
    for anthropic in (True, False):
        stream = EventStream("/v1/messages" if anthropic else "/v1/chat/completions", {"timeout": 0.01})
        first = MESSAGE_START if anthropic else b'data: {"id": "chatcmpl-1", "choices": []}\n\n'
        stream.arrived(body(first))
        sent = [*stream.outgoing(body(first)), *stream.outgoing(body(HEARTBEAT)), *stream.outgoing(END)]
        assert sent[-1] == END
        got = events(sent)
        if anthropic:
            assert [name for name, _ in got] == ["message_start", "ping", "error", "message_stop"]
            error = got[2][1]["error"]
            assert error["type"] == "timeout_error" and "request timeout (0.01 s)" in error["message"]
        else:
            assert [name for name, _ in got] == ["data", "comment", "data", "data"]
            error = got[2][1]["error"]
            assert error["code"] == 504 and error["type"] == "timeout_error" and "request timeout" in error["message"]
            assert b"".join(m["body"] for m in sent).endswith(b"data: [DONE]\n\n")


def test_a_stream_cut_short_otherwise_says_so_without_blaming_the_timeout() -> None:
    stream = EventStream("/v1/chat/completions", {"timeout": 300})
    stream.arrived(body(b'data: {"choices": []}\n\n'))
    got = events([*stream.outgoing(body(b'data: {"choices": []}\n\n')), *stream.outgoing(END)])
    assert got[1][1]["error"]["code"] == 500 and "ended before the response completed" in got[1][1]["error"]["message"]


def run_stream(ctx: asgi.RequestContext, host: list[Message], record_after: int | None = None) -> list[Message]:
    """The host's messages through HoldingSend with ``ctx`` current; the engine records its usage and starts
    (``engine_started``) just before message ``record_after``."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def run() -> None:
        token = asgi.CURRENT.set(ctx)
        try:
            holding = asgi.HoldingSend(send, ctx)
            for i, message in enumerate(host):
                if i == record_after:
                    usage.record(prompt_tokens=120, cached_tokens=100)
                    ctx.engine_started = True
                await holding(message)
        finally:
            asgi.CURRENT.reset(token)

    asyncio.run(run())
    return sent


def test_a_held_message_start_reports_the_prompt_and_its_cache_reads_as_anthropic_counts_them() -> None:
    ctx = asgi.RequestContext(path="/v1/messages", body={"timeout": 100})
    delta = anthropic_event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}})
    host = [START, body(MESSAGE_START), body(delta), body(MESSAGE_DELTA), body(MESSAGE_STOP), END]
    # the engine records after the host wrote message_start (held) and before the first delta
    sent = run_stream(ctx, host, record_after=2)
    got = dict(events(sent))
    assert got["message_start"]["message"]["usage"] == {"input_tokens": 20, "output_tokens": 0, "cache_read_input_tokens": 100}
    assert got["message_delta"]["usage"] == {"output_tokens": 7, "input_tokens": 20, "cache_read_input_tokens": 100}
    assert got["message_delta"]["delta"]["stop_reason"] == "end_turn"
    assert sent[0] == START and sent[-1] == END


def test_a_response_cut_by_max_tokens_says_max_tokens_in_its_stream() -> None:
    ctx = asgi.RequestContext(path="/v1/messages", body={"timeout": 100})
    host = [START, body(MESSAGE_START), body(MESSAGE_DELTA), body(MESSAGE_STOP), END]
    token = asgi.CURRENT.set(ctx)
    try:
        usage.record(prompt_tokens=50, cached_tokens=0, finish_reason="length")
    finally:
        asgi.CURRENT.reset(token)
    got = dict(events(run_stream(ctx, host)))
    assert got["message_delta"]["delta"]["stop_reason"] == "max_tokens"
    assert got["message_start"]["message"]["usage"]["input_tokens"] == 50


def test_openai_streams_pass_unamended() -> None:
    ctx = asgi.RequestContext(path="/v1/chat/completions", body={"timeout": 100})
    chunk = b'data: {"id": "chatcmpl-9", "choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
    host = [START, body(chunk), body(HEARTBEAT), body(b"data: [DONE]\n\n"), END]
    sent = run_stream(ctx, host, record_after=1)
    assert sent == host and ctx.response_id == "chatcmpl-9"


def test_a_responses_stream_ends_on_response_completed_and_silently_never() -> None:
    """The Responses API ends with ``response.completed`` (an incomplete answer too): no error frame after it; a
    Responses stream that stops short gets the API's ``error`` event."""
    completed = anthropic_event("response.completed", {"type": "response.completed", "response": {"status": "incomplete"}})
    done = EventStream("/v1/responses", {})
    assert done.outgoing(body(completed)) == [body(completed)]
    assert done.outgoing(END) == [END]
    short = EventStream("/v1/responses", {})
    sent = short.outgoing(END)
    assert [name for name, _ in events(sent)] == ["error"]
    assert events(sent)[0][1]["type"] == "error" and sent[-1] == END
