"""Image requests through the real server as rows of the text batch (fp32 tiny model): the host's output, batched ==
alone, MTP drafting, a second turn resuming past its image, bad images and hang-ups leaving every counter at 0."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from PIL import Image

from support.plugin_status import plugin_status, wait_idle
from support.server import Server, serve

pytestmark = pytest.mark.server

FLAGS = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--enable-mtp", "--max-num-seqs", "4",
         "--prefill-step-size", "32")


def image_url(rgb: tuple[int, int, int], size: tuple[int, int] = (160, 128)) -> str:
    img = Image.new("RGB", size, rgb)
    for x in range(0, size[0], 8):  # stripes, so patches differ
        for y in range(size[1]):
            img.putpixel((x, y), (255 - rgb[0], rgb[1], 255 - rgb[2]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(rgb: tuple[int, int, int], text: str = "Describe the picture.") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(rgb)}}, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def plugin(tiny_vlm_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tiny_vlm_fp32, *FLAGS, log_dir=tmp_path_factory.mktemp("media-logs")) as server:
        yield server


@pytest.fixture(scope="module")
def host(tiny_vlm_fp32: Path, shared_server: Callable[..., Server]) -> Server:
    return shared_server(tiny_vlm_fp32, "--continuous-batching", "--mllm")


def complete(server: Server, messages: list[dict], max_tokens: int = 14) -> tuple[str, int]:
    out = server.openai(timeout=180).chat.completions.create(
        model=server.model, messages=messages, max_tokens=max_tokens, temperature=0
    )
    details = out.usage.prompt_tokens_details if out.usage is not None else None
    # The host ends a text cut inside a character with U+FFFD; the plugin holds such a tail back (as on text rows).
    return (out.choices[0].message.content or "").rstrip("\ufffd"), int(getattr(details, "cached_tokens", 0) or 0)


def test_image_requests_are_rows_of_the_text_batch_with_the_hosts_output(plugin: Server, host: Server) -> None:
    before = plugin_status(plugin)
    outs = []
    for rgb in [(250, 20, 20), (20, 250, 20), (20, 20, 250)]:
        text, _ = complete(plugin, [image_message(rgb)])
        assert text == complete(host, [image_message(rgb)])[0], rgb
        outs.append(text)
    assert len(set(outs)) == 3  # the pixels reach the model
    after = plugin_status(plugin)
    assert after["routing"]["media"] == before["routing"]["media"] + 3
    assert after["text_engine"]["media_rows"] == before["text_engine"]["media_rows"] + 3
    assert after["mtp"]["media_rows"]["drafted"] > before["mtp"]["media_rows"]["drafted"]  # image rows draft
    wait_idle(plugin, 30)


def test_streams_of_images_and_text_together_equal_alone(plugin: Server) -> None:
    jobs = [[image_message((200, 100, 0))], [{"role": "user", "content": "Write a haiku about the sea."}],
            [image_message((0, 90, 200), "What colour is it?")], [{"role": "user", "content": "def fib(n):"}]]
    alone = [complete(plugin, m, 16)[0] for m in jobs]

    async def together() -> list[str]:
        client = plugin.async_openai(timeout=180)

        async def one(i: int, messages: list[dict]) -> str:
            await asyncio.sleep(0.05 * i)
            stream = await client.chat.completions.create(model=plugin.model, messages=messages, max_tokens=16, temperature=0,
                                                          stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        return await asyncio.gather(*(one(i, m) for i, m in enumerate(jobs)))

    assert asyncio.run(together()) == alone
    wait_idle(plugin, 30)


def test_second_turn_resumes_past_the_same_image(plugin: Server, host: Server) -> None:
    first = [image_message((90, 200, 120), "What colour dominates in this picture?")]
    reply, cached = complete(plugin, first, 8)
    assert cached == 0
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And the stripes?"}]
    text, cached = complete(plugin, second, 10)
    assert cached > 40  # past the image (its tokens alone are 20)
    assert text == complete(host, second, 10)[0]
    other = [image_message((200, 90, 120), "What colour dominates in this picture?"), *second[1:]]
    assert complete(plugin, other, 10)[1] < 10  # a different image of the same size: no hit past it
    wait_idle(plugin, 30)


@pytest.mark.parametrize("url", ["data:image/png;base64,bm90IGFuIGltYWdl", "data:image/png;base64,%%%", "ftp://example.com/a.png"])
def test_a_bad_image_is_a_400_and_the_server_serves_on(plugin: Server, url: str) -> None:
    body = {"model": plugin.model, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}
    r = plugin.post("/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "image" in r.text
    assert complete(plugin, [image_message((10, 10, 10))], 4)[0]
    wait_idle(plugin, 30)


def test_image_streams_hung_up_mid_way_leave_nothing_behind(plugin: Server) -> None:
    body = {"model": plugin.model, "max_tokens": 200, "stream": True, "temperature": 0,
            "messages": [image_message((120, 120, 30), "Tell me a long story about this picture.")]}
    for _ in range(3):
        with plugin.client(timeout=60) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for n, _line in enumerate(r.iter_lines()):
                if n > 6:
                    break  # hang up
    wait_idle(plugin, 60)
    assert complete(plugin, [image_message((120, 120, 30))], 4)[0]
    wait_idle(plugin, 30)


def test_audio_stays_on_the_hosts_path_with_its_reason(plugin: Server) -> None:
    before = plugin_status(plugin)["fallback_reasons"].get("media: audio", 0)
    body = {"model": plugin.model, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}, {"type": "text", "text": "hi"}]}]}
    plugin.post("/v1/chat/completions", json=body, timeout=60)  # the host's answer, whatever it is
    assert plugin_status(plugin)["fallback_reasons"].get("media: audio", 0) == before + 1
    wait_idle(plugin, 30)


def test_a_long_image_prompt_beside_running_streams(plugin: Server) -> None:
    """Three images and a long text prefill in the budget's items while two text streams decode: every answer is the
    one it gets alone, and every counter ends at 0."""
    long_text = "Compare the three pictures, one paragraph each, then rank them. " * 12
    images = {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": image_url(rgb)}}
                                            for rgb in [(200, 10, 10), (10, 200, 10), (10, 10, 200)]),
                                          {"type": "text", "text": long_text}]}
    streams = [[{"role": "user", "content": "Write a long poem about rivers."}], [{"role": "user", "content": "def parse(line):"}]]
    alone = [complete(plugin, m, 40)[0] for m in streams] + [complete(plugin, [images], 12)[0]]

    async def together() -> list[str]:
        client = plugin.async_openai(timeout=300)

        async def one(messages: list[dict], n: int, delay: float) -> str:
            await asyncio.sleep(delay)
            stream = await client.chat.completions.create(model=plugin.model, messages=messages, max_tokens=n, temperature=0,
                                                          stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        return await asyncio.gather(one(streams[0], 40, 0), one(streams[1], 40, 0), one([images], 12, 0.3))

    assert [t.rstrip("\ufffd") for t in asyncio.run(together())] == alone
    wait_idle(plugin, 30)
