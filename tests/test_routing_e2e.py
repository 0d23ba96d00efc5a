"""Routing through the real server (fp32 tiny model): outputs equal the host's, media keeps its pixels."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.server import Server, png_data_url, serve

pytestmark = pytest.mark.server

PROMPTS = [
    "def",
    "import os\nimport sys\n\nclass Loader:\n    def __init__(self, path):\n        self.path = path",
    "Write a function that parses a configuration file and returns a dictionary of sections " * 3,
    "x = 1",
    "for i in range(10):\n    print(i)\n" * 6,
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def plugin_server(tiny_vlm_fp32: Path, logs: Path) -> Iterator[Server]:
    flags = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--enable-mtp", "--max-num-seqs", "4", "--prefill-step-size", "32")
    with serve(tiny_vlm_fp32, *flags, log_dir=logs) as server:
        yield server


@pytest.fixture(scope="module")
def host_server(tiny_vlm_fp32: Path, shared_server: Callable[..., Server]) -> Server:
    return shared_server(tiny_vlm_fp32, "--continuous-batching", "--mllm")  # the stock host, as in test_server_bridge_e2e


def chat_text(server: Server, messages: list[dict], max_tokens: int = 12) -> str:
    client = server.openai(timeout=180)
    out = client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content or ""


def routing(server: Server) -> dict[str, int]:
    return server.get("/v1/status").json()["plugins"]["mtp-routing"]["routing"]


def test_text_greedy_equals_host(plugin_server: Server, host_server: Server) -> None:
    before = routing(plugin_server)["text"]
    for prompt in PROMPTS[:3]:
        messages = [{"role": "user", "content": prompt}]
        assert chat_text(plugin_server, messages) == chat_text(host_server, messages), prompt
    assert routing(plugin_server)["text"] == before + 3


def test_concurrent_requests_equal_alone(plugin_server: Server) -> None:
    alone = [chat_text(plugin_server, [{"role": "user", "content": p}], 16) for p in PROMPTS]

    async def burst() -> list[str]:
        client = plugin_server.async_openai(timeout=180)

        async def one(i: int, p: str) -> str:
            await asyncio.sleep(0.05 * i)  # arrive at different steps
            out = await client.chat.completions.create(
                model=plugin_server.model, messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0
            )
            return out.choices[0].message.content or ""

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    assert asyncio.run(burst()) == alone


def image_chat(server: Server, rgb: tuple[int, int, int]) -> str:
    content = [{"type": "text", "text": "Describe the picture."}, {"type": "image_url", "image_url": {"url": png_data_url(rgb)}}]
    return chat_text(server, [{"role": "user", "content": content}], 16)


def test_images_keep_their_pixels_with_enable_mtp(plugin_server: Server) -> None:
    before = routing(plugin_server)["media"]
    black, white = image_chat(plugin_server, (0, 0, 0)), image_chat(plugin_server, (255, 255, 255))
    assert black != white
    assert routing(plugin_server)["media"] == before + 2


def test_mid_conversation_system_message(plugin_server: Server) -> None:
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def f():"},
        {"role": "assistant", "content": "    return 1"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def g():"},
    ]
    response = plugin_server.post(
        "/v1/chat/completions",
        json={"model": plugin_server.model, "messages": messages, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text


def test_anthropic_endpoint_on_text_path(plugin_server: Server) -> None:
    before = routing(plugin_server)["text"]
    client = plugin_server.anthropic()
    msg = client.messages.create(
        model=plugin_server.model, max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "import json"}]
    )
    assert msg.usage.output_tokens > 0
    with client.messages.stream(model=plugin_server.model, max_tokens=6, messages=[{"role": "user", "content": "x ="}]) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed
    assert routing(plugin_server)["text"] >= before + 2


def test_stream_text_equals_non_stream(plugin_server: Server) -> None:
    client = plugin_server.openai(timeout=180)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chunks = client.chat.completions.create(model=plugin_server.model, messages=messages, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat_text(plugin_server, messages)


def test_stream_with_a_stop_string_spanning_tokens_equals_non_stream(plugin_server: Server) -> None:
    """A stop string from the last 2 characters of one token's text to the first 2 of the next: the text path holds
    back what could still be a stop's start (text_engine.detokenize, whose hold-back the media path shares in
    stop_strings.py), so no delta shows any of it and the deltas join to the non-streamed text, cut before it."""
    client = plugin_server.openai(timeout=180)
    kw = {"model": plugin_server.model, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 16, "temperature": 0}
    pieces = [e.token for e in client.chat.completions.create(**kw, logprobs=True).choices[0].logprobs.content]
    full, ends = "".join(pieces), [len("".join(pieces[: k + 1])) for k in range(len(pieces))]
    k = next(k for k in range(1, len(pieces) - 1) if min(len(pieces[k]), len(pieces[k + 1])) >= 2
             and full.find(full[ends[k] - 2 : ends[k] + 2]) == ends[k] - 2 and full[: ends[k] - 2].strip() == full[: ends[k] - 2])
    stop = full[ends[k] - 2 : ends[k] + 2]
    out = client.chat.completions.create(**kw, stop=[stop]).choices[0]
    assert out.message.content == full[: ends[k] - 2] and out.finish_reason == "stop"
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stop=[stop], stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == out.message.content and chunks[-1].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(plugin_server: Server) -> None:
    def body(seed: object) -> dict:
        return {"model": plugin_server.model, "messages": [{"role": "user", "content": "def main():"}],
                "max_tokens": 12, "temperature": 1.0, "seed": seed}

    url = "/v1/chat/completions"
    first = plugin_server.post(url, json=body(7), timeout=120).json()["choices"][0]["message"]["content"]

    async def together() -> list[str]:
        async with plugin_server.async_client(timeout=120) as client:
            rs = await asyncio.gather(*(client.post(url, json=body(s)) for s in (7, 8, 7, 9)))
            return [r.json()["choices"][0]["message"]["content"] for r in rs]

    batch = asyncio.run(together())
    assert batch[0] == batch[2] == first
    assert len({first, batch[1], batch[3]}) > 1  # other seeds sample other text
    bad = plugin_server.post(url, json=body("seven"), timeout=60)
    assert bad.status_code == 400 and "seed" in bad.json()["error"]["message"]


def test_seed_zero_is_a_seed_alone_and_in_a_batch(plugin_server: Server) -> None:
    """Seed 0 is a seed like any other: the same request twice gives the same text, alone and beside other requests,
    and its n = 2 copies are seeds 0 and 1; a request without a seed samples other text. (A `seed or ...` slip
    anywhere on its path, the pre-generation hook, the routing's options, the row's sampler or the copies' seed + j,
    treats 0 as no seed.)"""
    url = "/v1/chat/completions"

    def body(seed: int | None, **kw: object) -> dict:
        return {"model": plugin_server.model, "messages": [{"role": "user", "content": "def main():"}], "max_tokens": 12,
                "temperature": 1.0, **({} if seed is None else {"seed": seed}), **kw}

    def texts(r) -> list[str]:
        return [c["message"]["content"] for c in r.json()["choices"]]

    zero, one = (texts(plugin_server.post(url, json=body(s), timeout=120))[0] for s in (0, 1))

    async def together() -> list[list[str]]:
        async with plugin_server.async_client(timeout=120) as client:
            rs = await asyncio.gather(*(client.post(url, json=b) for b in (body(0), body(None), body(0, n=2), body(1))))
            return [texts(r) for r in rs]

    batch = asyncio.run(together())
    assert batch[0] == [zero] and batch[2] == [zero, one] and batch[3] == [one]
    assert zero != one and batch[1][0] != zero  # seed 0 is not "no seed"
