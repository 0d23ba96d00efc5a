"""Reliability through the real server: hang-ups, hostile parameters, cancel by id, what fits the context, long waits
and the host's timeout in each client's protocol.

Each test ends with the server's counters back at 0: no request may leak a slot or a text-engine row.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from support.plugin_status import SHARED_FLAGS, plugin_status, wait_idle
from support.server import Server, serve

pytestmark = pytest.mark.server

LONG = 400  # tokens a stream would run for if nobody stopped it
CONTEXT = 1024  # the module server's model context (tiny_vlm_bf16_1k): a prompt can leave it a few tokens cheaply
TIMEOUT_PROMPT_REPEATS = 1000  # ~10K tokens: a prefill that outlasts a 1 s --timeout several times over


@pytest.fixture(scope="module")
def server(tiny_vlm_bf16_1k: Path, shared_server: Callable[..., Server]) -> Server:
    return shared_server(tiny_vlm_bf16_1k, *SHARED_FLAGS)  # the shared flags, on a model whose context a prompt can fill cheaply


def body(server: Server, content: str, **kw: object) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


async def stream_then_hang_up(client: httpx.AsyncClient, payload: dict, chunks: int) -> int:
    got = 0
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                got += 1
                if got >= chunks:
                    break  # leaving the block closes the connection mid-stream
    return got


def test_hang_ups_release_slots_and_rows(server: Server) -> None:
    async def run() -> list[int]:
        async with server.async_client(timeout=120) as client:
            payload = body(server, "def handler(event):", max_tokens=LONG, stream=True)
            return await asyncio.gather(*(stream_then_hang_up(client, payload, 2) for _ in range(8)))

    assert asyncio.run(run()) == [2] * 8
    assert wait_idle(server, within=2.0) <= 2.0
    t0 = time.monotonic()
    r = server.post("/v1/chat/completions", json=body(server, "x = 1", max_tokens=4), timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 10
    assert plugin_status(server)["admission"]["completed"] >= 9


def test_bad_seed_beside_running_streams_is_400_and_they_complete(server: Server) -> None:
    async def run() -> tuple[list[str], list[httpx.Response]]:
        async with server.async_client(timeout=120) as client:
            async def full(i: int) -> str:
                payload = body(server, f"class Item{i}:", max_tokens=48, stream=True, seed=i, temperature=0.8)
                async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
                    return "".join([line async for line in response.aiter_lines()])

            streams = [asyncio.create_task(full(i)) for i in range(3)]
            await asyncio.sleep(0.5)
            bad = [await client.post("/v1/chat/completions", json=body(server, "y", max_tokens=8, seed=s, temperature=0.8))
                   for s in (-1, 2**64, 2**70)]
            return list(await asyncio.gather(*streams)), bad

    texts, bad = asyncio.run(run())
    for r in bad:
        assert r.status_code == 400, r.text
        assert "seed" in r.json()["error"]["message"]
    for text in texts:
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        assert '"finish_reason":"length"' in text.replace(" ", "")
    wait_idle(server, within=2.0)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("min_p", 1.5), ("min_p", -0.1),
    ("frequency_penalty", 3.0), ("presence_penalty", -2.5), ("repetition_penalty", 0.0), ("seed", 2**64),
    ("stop", [1, 2]), ("stop", ["x"] * 17), ("max_tokens", 0), ("timeout", -3e16), ("timeout", -1),
])
def test_out_of_range_parameter_is_400_naming_it(server: Server, field: str, value: object) -> None:
    for stream in (False, True):
        r = server.post("/v1/chat/completions", json=body(server, "hello", **{"max_tokens": 4, "stream": stream, field: value}), timeout=30)
        assert r.status_code in (400, 422), (field, value, r.status_code, r.text)  # 422: the host's own schema check
        assert field in r.text


def test_a_prompt_over_the_context_is_400_before_any_prefill(server: Server) -> None:
    before = plugin_status(server)["text_engine"]["prompt_tokens_processed"]
    client = server.openai(timeout=120)
    long_prompt = "alpha beta gamma delta " * 400  # over the module model's context
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="context"):
            client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": long_prompt}], max_tokens=4,
                                           stream=stream)
    with pytest.raises(anthropic.BadRequestError, match="context"):
        server.anthropic(timeout=120).messages.create(model=server.model, max_tokens=4,
                                                      messages=[{"role": "user", "content": long_prompt}])
    assert plugin_status(server)["text_engine"]["prompt_tokens_processed"] == before
    wait_idle(server, within=2.0)


def filler(server: Server, room: int) -> str:
    """A user message whose chat prompt leaves about ``room`` tokens of the model's context (its length read
    from the server: the tiny tokenizer is trained per run)."""
    def prompt_tokens(repeats: int) -> int:
        r = server.post("/v1/chat/completions", json=body(server, "alpha beta gamma delta " * repeats, max_tokens=1), timeout=60)
        return int(r.json()["usage"]["prompt_tokens"])

    a, b = prompt_tokens(8), prompt_tokens(24)
    repeats = 8 + int((CONTEXT - room - a) * 16 / (b - a))
    return "alpha beta gamma delta " * repeats


def test_max_tokens_over_the_context_is_cut_to_what_the_prompt_leaves(server: Server) -> None:
    """Coding agents send max_tokens 8000-32000 whatever the prompt: served as the host serves them, generating until
    the context is full and saying so (finish_reason length, Anthropic max_tokens), on every endpoint."""
    text = filler(server, room=40)
    messages = [{"role": "user", "content": text}]
    client = server.openai(timeout=120)
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=32000, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == CONTEXT and 0 < r.usage.completion_tokens < 100
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=32000, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens == CONTEXT
    response = client.responses.create(model=server.model, input=text, max_output_tokens=32000, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens + response.usage.output_tokens == CONTEXT
    ac = server.anthropic(timeout=120)
    message = ac.messages.create(model=server.model, max_tokens=32000, messages=messages, extra_body={"temperature": 0})
    with ac.messages.stream(model=server.model, max_tokens=32000, messages=messages, extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    for m in (message, streamed):
        assert m.stop_reason == "max_tokens"
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + m.usage.output_tokens == CONTEXT
    assert streamed.usage.output_tokens == message.usage.output_tokens
    wait_idle(server, within=2.0)


def test_cancel_by_response_id_stops_a_text_stream_and_counts_show(server: Server) -> None:
    async def run() -> tuple[str, dict, dict, float]:
        async with server.async_client(timeout=120) as client:
            payload = body(server, "def main():", max_tokens=LONG, stream=True)
            lines: list[str] = []
            async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
                it = response.aiter_lines()
                while not any(line.startswith("data: {") and '"content"' in line for line in lines):
                    lines.append(await it.__anext__())
                response_id = json.loads(lines[0][len("data: "):])["id"]
                status = (await client.get("/v1/status")).json()
                health = (await client.get("/health")).json()
                t0 = time.monotonic()
                cancel = await client.post(f"/v1/requests/{response_id}/cancel")
                assert cancel.status_code == 200, cancel.text
                lines += [line async for line in it]
                return "\n".join(lines), status, health, time.monotonic() - t0

    text, status, health, took = asyncio.run(run())
    assert status["num_running"] >= 1
    assert took < 5
    assert text.count('"content"') < LONG // 2
    assert text.rstrip().endswith("data: [DONE]")
    wait_idle(server, within=2.0)
    assert server.post("/v1/requests/chatcmpl-nosuch/cancel", timeout=10).status_code == 404


def test_clear_cache_route_serves_the_text_path(server: Server) -> None:
    with server.client(timeout=30) as c:
        r = c.delete("/v1/cache")
    assert r.status_code == 200
    assert "text_path" in json.dumps(r.json())


def test_a_fallback_keeps_stop_strings_and_says_why(server: Server) -> None:
    """Without an MTP head a request for the host's drafter goes to the mlx-vlm path: counted with its reason
    (logged once), its stop strings still honoured, a seed it cannot honour counted."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "temperature": 0,
            "mllm_draft": True}
    before = plugin_status(server)
    full = server.post("/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"]
    stop = full[4:7]
    cut = server.post("/v1/chat/completions", json={**body, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert cut["message"]["content"] == full[: full.find(stop)] and cut["finish_reason"] == "stop"
    server.post("/v1/chat/completions", json={**body, "temperature": 0.7, "seed": 3}, timeout=60)
    after = plugin_status(server)
    assert after["routing"]["fallback"] - before["routing"]["fallback"] == 3
    reason = "a host drafter was requested and the text path has no MTP head"
    assert after["fallback_reasons"][reason] - before["fallback_reasons"].get(reason, 0) == 3
    assert after["host_path_ignored"]["seed"] - before["host_path_ignored"].get("seed", 0) == 1
    assert server.log().count("goes to the host's mlx-vlm path") == 1
    wait_idle(server, within=2.0)


def test_a_long_wait_gets_the_response_start_and_keep_alives_then_an_error_frame(tiny_vlm_bf16: Path, tmp_path: Path) -> None:
    """In each client's protocol: an OpenAI stream gets the host's heartbeat comments and an error frame, an Anthropic
    stream ``ping`` events (which its clients count as life, where a comment is not) and an ``error`` event."""
    flags = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "1",
             "--scheduler-queue-timeout", "7")
    with serve(tiny_vlm_bf16, *flags, log_dir=tmp_path) as s:
        async def run() -> tuple[tuple[int, float, str], tuple[int, float, str]]:
            async with s.async_client(timeout=120) as client:
                async def blocker() -> None:  # holds the only slot longer than the queue timeout
                    payload = body(s, "def loop():", max_tokens=6000, stream=True)
                    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: {"):
                                decoding.set()
                            if stop.is_set():
                                return

                async def waiting(path: str, payload: dict) -> tuple[int, float, str]:
                    t0 = time.monotonic()
                    async with client.stream("POST", path, json=payload) as response:
                        started = time.monotonic() - t0
                        text = "".join([line + "\n" async for line in response.aiter_lines()])
                    return response.status_code, started, text

                stop, decoding = asyncio.Event(), asyncio.Event()
                task = asyncio.create_task(blocker())
                # the wait starts once the blocker holds the slot (its first token came), not after a fixed sleep:
                # every second before it is a second of decoding the test does not need
                await asyncio.wait_for(decoding.wait(), timeout=60)
                anthropic_payload = {"model": s.model, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "y"}]}
                results = await asyncio.gather(waiting("/v1/chat/completions", body(s, "x", max_tokens=4, stream=True)),
                                               waiting("/v1/messages", anthropic_payload))
                stop.set()
                await task
                return results[0], results[1]

        (status, started, text), (a_status, a_started, a_text) = asyncio.run(run())
        assert status == 200 and started < 7  # the response started while the request still waited
        assert ": heartbeat" in text
        assert '"error"' in text and "server busy" in text and text.rstrip().endswith("data: [DONE]")
        assert a_status == 200 and a_started < 7
        assert "event: ping" in a_text and ": heartbeat" not in a_text
        assert "event: error" in a_text and "server busy" in a_text and a_text.rstrip().endswith('data: {"type": "message_stop"}')
        start = json.loads(a_text.split("event: message_start\ndata: ", 1)[1].split("\n", 1)[0])
        assert start["message"]["usage"]["input_tokens"] > 0  # the prompt, known before admission
        wait_idle(s, within=2.0)


def test_a_stream_the_host_times_out_ends_with_an_error_event(tiny_vlm_bf16: Path, tmp_path: Path) -> None:
    """The host's --timeout (no output for that long: here a prefill) ends a stream; the client is told so, in its
    protocol, instead of a silent end it would read as a complete answer."""
    flags = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--timeout", "1", "--disable-prefix-cache")
    with serve(tiny_vlm_bf16, *flags, log_dir=tmp_path) as s:
        async def run() -> list[str]:
            async with s.async_client(timeout=120) as client:
                async def stream(path: str, payload: dict) -> str:
                    async with client.stream("POST", path, json=payload) as response:
                        assert response.status_code == 200
                        return "".join([line + "\n" async for line in response.aiter_lines()])

                prompt = "alpha beta gamma delta " * TIMEOUT_PROMPT_REPEATS  # a prefill longer than the timeout
                return list(await asyncio.gather(
                    stream("/v1/chat/completions", body(s, "1 " + prompt, max_tokens=4, stream=True)),
                    stream("/v1/messages", {"model": s.model, "max_tokens": 4, "stream": True,
                                            "messages": [{"role": "user", "content": "2 " + prompt}]}),
                ))

        text, a_text = asyncio.run(run())
        frames = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert "error" in frames[-1] and frames[-1]["error"]["code"] == 504 and "timeout" in frames[-1]["error"]["message"]
        assert not any(f.get("choices") and f["choices"][0].get("finish_reason") for f in frames)
        assert text.rstrip().endswith("data: [DONE]")
        names = [line[7:] for line in a_text.splitlines() if line.startswith("event: ")]
        assert names[0] == "message_start" and names[-2:] == ["error", "message_stop"] and "message_delta" not in names
        assert '"timeout_error"' in a_text
        assert "ended by the host's timeout" in s.log()
        wait_idle(s, within=5.0)
