"""Text prompts prepared on the worker thread, through the real server: many long prompts at once
beside image requests (the host's path, tokenizing on the event loop) and raw completions; every text
answer equals the same request served alone, every request succeeds, the counters end at 0."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.server import Server, png_data_url, serve

pytestmark = pytest.mark.server

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def _code(i: int) -> str:  # ~380 tokens: long enough to be worth preparing off the loop (asserted below)
    return "".join(f"def step_{i}_{k}(x):\n    return x * {k} + {i}  # café ✓\n" for k in range(12))


def _conversations() -> list[tuple[list[dict], list | None]]:
    out: list[tuple[list[dict], list | None]] = []
    for i in range(6):
        out.append(([{"role": "system", "content": "You review Python code."}, {"role": "user", "content": _code(i)}], TOOLS if i % 2 else None))
    for i in range(3):
        out.append(([
            {"role": "user", "content": f"Read module {i}"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": f'{{"path": "m{i}.py"}}'}}]},
            {"role": "tool", "content": _code(10 + i), "tool_call_id": "c1"},
        ], TOOLS))
    return out


@pytest.fixture(scope="module")
def server(tiny_vlm_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "4", "--prefill-step-size", "128")
    with serve(tiny_vlm_fp32, *flags, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def test_long_prompts_at_once_beside_images_equal_alone(server: Server, tiny_vlm_fp32: Path) -> None:
    conversations = _conversations()
    raw = [f"# file {i}\n" + _code(20 + i) for i in range(3)]
    client = server.async_openai(timeout=300)

    async def chat(messages: list[dict], tools: list | None) -> tuple[str, int]:
        kw = {"tools": tools} if tools else {}
        out = await client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0, **kw)
        return out.choices[0].message.content or "", out.usage.prompt_tokens

    async def complete(prompt: str) -> tuple[str, int]:
        out = await client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
        return out.choices[0].text, out.usage.prompt_tokens

    async def image(rgb: tuple[int, int, int]) -> str:
        content = [{"type": "text", "text": "Describe the picture."}, {"type": "image_url", "image_url": {"url": png_data_url(rgb)}}]
        out = await client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}], max_tokens=4)
        return out.choices[0].finish_reason

    async def burst() -> tuple[list, list, list]:
        return await asyncio.gather(
            asyncio.gather(*(chat(m, t) for m, t in conversations)),
            asyncio.gather(*(complete(p) for p in raw)),
            asyncio.gather(*(image((40 * i, 0, 255 - 40 * i)) for i in range(3))),
        )

    async def alone() -> tuple[list, list]:
        return [await chat(m, t) for m, t in conversations], [await complete(p) for p in raw]

    async def both() -> tuple:
        return await burst(), await alone()

    (together_chat, together_raw, images), (alone_chat, alone_raw) = asyncio.run(both())
    assert together_chat == alone_chat and together_raw == alone_raw
    assert all(n > 300 for _, n in together_chat + together_raw)  # long enough to be worth moving off the loop
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_vlm_fp32))  # the prompt's tokens are the model's own
    for (messages, tools), (_, n) in zip(conversations, together_chat):
        if tools is None:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
            assert n == len(tok.encode(text, add_special_tokens=False))
    assert [n for _, n in together_raw] == [len(tok.encode(p, add_special_tokens=False)) for p in raw]
    assert all(reason in ("stop", "length") for reason in images)
    status = server.get("/v1/status", timeout=10).json()["plugins"]["mtp-routing"]
    assert status["routing"]["media"] >= 3
    a, t = status["admission"], status["text_engine"]
    assert (a["running"], a["queued"], t["running"], t["prefilling"], t["waiting"]) == (0, 0, 0, 0, 0)
    # the snapshot positions found on the worker were used: the repeated conversations hit the cache
    assert status["prefix_cache"]["hits"] >= len(conversations)
