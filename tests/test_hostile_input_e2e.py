"""Hostile requests through the real server: huge bodies, compressed-body bombs, an image decompression bomb, absurd
max_tokens and n, thousands of messages. Each is a clear 4xx within seconds, the counters go back to 0 and the server
serves the next request (docs/robustness.md has what the host alone does with each).
"""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from support.plugin_status import SHARED_FLAGS, wait_idle
from support.server import Server

pytestmark = pytest.mark.server

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tiny_vlm_bf16: Path, shared_server: Callable[..., Server]) -> Server:
    return shared_server(tiny_vlm_bf16, *SHARED_FLAGS)


def chat(server: Server, **kw: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **kw}


def refused(server: Server, status: int, words: str, *, path: str = CHAT, content: bytes | None = None,
            headers: dict[str, str] | None = None, **body: Any) -> None:
    payload = content if content is not None else json.dumps(body).encode()
    r = server.post(path, content=payload, headers={"content-type": "application/json", **(headers or {})}, timeout=60)
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert words in r.text, r.text[:300]
    wait_idle(server, within=5.0)
    assert server.post(CHAT, json=chat(server), timeout=60).status_code == 200


def png_bomb(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (far past Pillow's decompression-bomb limit) and whose
    data is a few bytes: it takes no time to send, and whoever decodes it as declared runs out of memory."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_a_50_mb_prompt_is_refused_without_tokenizing_it_all(server: Server) -> None:
    # 26M tokens: tokenizing it whole took 64 s and 11.7 GB before the context check refused it
    refused(server, 400, "the model's context is", **chat(server, messages=[{"role": "user", "content": "a " * (25 * 2**20)}]))


@pytest.mark.parametrize("coding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_a_compressed_body_is_415(server: Server, coding: str, compress: Callable[[bytes], bytes]) -> None:
    bomb = compress(json.dumps(chat(server)).encode() + b" " * (64 << 20))  # 64 MiB of spaces in ~64 KiB
    refused(server, 415, f"Content-Encoding '{coding}' is not supported", content=bomb, headers={"content-encoding": coding})


def test_an_image_decompression_bomb_is_400(server: Server) -> None:
    import base64

    url = "data:image/png;base64," + base64.b64encode(png_bomb(30000, 30000)).decode()
    content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]
    refused(server, 400, "exceeds limit", **chat(server, messages=[{"role": "user", "content": content}]))


@pytest.mark.parametrize("path,body", [
    (CHAT, {"max_tokens": 10**12}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}),
    ("/v1/messages", {"max_tokens": 10**12}),
])
def test_max_tokens_1e12_is_400(server: Server, path: str, body: dict[str, Any]) -> None:
    raw = json.dumps({**chat(server), **body}).replace(str(10**12), "1e12").encode()  # as a JSON float, as sent
    refused(server, 400, "max_tokens", path=path, content=raw)


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_n_1000_is_400(server: Server, path: str) -> None:
    extra = {"prompt": "hi"} if path == "/v1/completions" else {}
    refused(server, 400, "n must be an integer in [1, 16]", path=path, **chat(server, n=1000, **extra))


@pytest.mark.parametrize("path", [CHAT, "/v1/messages"])
def test_ten_thousand_messages_are_400(server: Server, path: str) -> None:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 5000
    refused(server, 400, "the model's context is", path=path, **chat(server, messages=[*turns, {"role": "user", "content": "end"}]))
