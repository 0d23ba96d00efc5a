"""End to end through the real server: the stock command with and without ``--plugins``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from support.server import Server, png_data_url, serve

pytestmark = pytest.mark.server

API_KEY = "test-key"


@pytest.fixture(scope="module")
def plugin_server(tiny_vlm_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(
        tiny_vlm_bf16,
        "--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--api-key", API_KEY,
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as server:
        yield server


def client(server: Server) -> openai.OpenAI:
    return server.openai(api_key=API_KEY, timeout=120)


def test_text_chat(plugin_server: Server) -> None:
    out = client(plugin_server).chat.completions.create(
        model=plugin_server.model, messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=8, temperature=0
    )
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage is not None and out.usage.completion_tokens > 0


def test_image_chat(plugin_server: Server) -> None:
    content = [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": png_data_url((255, 0, 0))}}]
    out = client(plugin_server).chat.completions.create(
        model=plugin_server.model, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
    )
    text_only = client(plugin_server).chat.completions.create(
        model=plugin_server.model, messages=[{"role": "user", "content": "Describe"}], max_tokens=1, temperature=0
    )
    assert out.usage is not None and out.usage.completion_tokens > 0 and text_only.usage is not None
    # the image became vision tokens in the prompt (a 64x64 image: 4 pads plus its start/end markers)
    assert out.usage.prompt_tokens >= text_only.usage.prompt_tokens + 4


def test_streamed_chat(plugin_server: Server) -> None:
    stream = client(plugin_server).chat.completions.create(
        model=plugin_server.model, messages=[{"role": "user", "content": "import os"}], max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_plugins_route_and_status(plugin_server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    plugins = plugin_server.get("/v1/plugins", headers=headers).json()["plugins"]
    assert [p["name"] for p in plugins] == ["mtp-routing"]
    assert plugins[0]["version"]
    status = plugin_server.get("/v1/status", headers=headers).json()
    assert "mtp-routing" in status["plugins"]


def test_plugin_routes_sit_behind_the_api_key(plugin_server: Server) -> None:
    assert plugin_server.get("/v1/plugins").status_code == 401
    assert plugin_server.get("/v1/status").status_code == 401


def test_without_plugins_runs_as_stock(tiny_vlm_fp32: Path, shared_server: Callable[..., Server]) -> None:
    server = shared_server(tiny_vlm_fp32, "--continuous-batching", "--mllm")  # the stock host, as in test_routing_e2e
    assert server.get("/v1/plugins").status_code == 404
    assert "plugins" not in server.get("/v1/status").json()
    out = server.openai().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert out.usage is not None and out.usage.completion_tokens > 0
    assert "Plugins loaded" not in server.log()
