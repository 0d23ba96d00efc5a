"""``cache_salt`` through the real server: requests with different salts, or one salted and one not, never share a
prefix-cache entry (how fast a request starts would tell one client what another sent); the same salt hits as an
unsalted request does. A salt that is not a non-empty string of at most 256 characters is a 400, on every
generation endpoint."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from support.plugin_status import SHARED_FLAGS, plugin_status, wait_idle
from support.server import Server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tiny_vlm_bf16: Path, shared_server: Callable[..., Server]) -> Server:
    return shared_server(tiny_vlm_bf16, *SHARED_FLAGS)


def system_prompt() -> str:
    """About 200 tokens no other test sends (a cache hit must come from this test's own requests)."""
    return f"Session {uuid.uuid4().hex}. " + "You review pull requests for a storage team; cite the file and line, keep it short. " * 12


def chat_cached(server: Server, system: str, salt: Any = None, question: str = "What changed?") -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) of one chat request."""
    body: dict[str, Any] = {"model": server.model, "max_tokens": 2, "temperature": 0,
                            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    if salt is not None:
        body["cache_salt"] = salt
    r = server.post("/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), usage["prompt_tokens"]


def hit_tokens(server: Server) -> int:
    return int(plugin_status(server)["prefix_cache"]["hit_tokens"])


def test_salts_never_share_and_the_same_salt_hits(server: Server) -> None:
    system = system_prompt()
    cached, prompt_tokens = chat_cached(server, system, "tenant-a")
    assert prompt_tokens >= 200 and cached == 0
    assert chat_cached(server, system, "tenant-b")[0] == 0
    assert chat_cached(server, system)[0] == 0  # unsalted: not tenant-a's entries either
    again, _ = chat_cached(server, system, "tenant-a")
    assert again >= prompt_tokens - 2  # the whole prompt but its last token(s), from tenant-a's own snapshot
    assert chat_cached(server, system, "tenant-a", question="And the tests?")[0] >= 200  # its system prefix
    assert chat_cached(server, system, "tenant-b", question="And the tests?")[0] >= 200  # b's own entries
    assert chat_cached(server, system, "tenant-c", question="And the tests?")[0] == 0
    wait_idle(server, within=5.0)


def test_every_generation_endpoint_keys_its_snapshots_by_the_salt(server: Server) -> None:
    bodies = {  # each its own text: a salt's entries serve every endpoint alike
        "/v1/completions": {"model": server.model, "prompt": system_prompt(), "max_tokens": 2},
        "/v1/messages": {"model": server.model, "max_tokens": 2, "system": system_prompt(), "messages": [{"role": "user", "content": "Hi"}]},
        "/v1/responses": {"model": server.model, "max_output_tokens": 2, "instructions": system_prompt(), "input": "Hi"},
    }
    for path, body in bodies.items():
        for salt, hits in (("x", False), ("y", False), (None, False), ("x", True)):
            before = hit_tokens(server)
            payload = body if salt is None else {**body, "cache_salt": salt}
            r = server.post(path, json=payload, timeout=60)
            assert r.status_code == 200, (path, r.text)
            assert (hit_tokens(server) > before + 100) == hits, (path, salt)
    # n copies of one salted request still prefill once and share it
    r = server.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2, "n": 2, "cache_salt": "z",
                                                  "messages": [{"role": "user", "content": system_prompt()}]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    wait_idle(server, within=5.0)


@pytest.mark.parametrize("salt", ["", "s" * 10_000, 5, True, ["a"], {"a": "b"}])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
def test_a_salt_that_is_not_a_bounded_string_is_400(server: Server, path: str, salt: Any) -> None:
    body = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    }[path]
    r = server.post(path, json={"model": server.model, **body, "cache_salt": salt}, timeout=30)
    assert r.status_code == 400 and "cache_salt" in r.text, r.text
    assert server.post(path, json={"model": server.model, **body, "cache_salt": "s" * 256}, timeout=60).status_code == 200
    wait_idle(server, within=5.0)
