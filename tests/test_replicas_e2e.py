"""Two replicas of the plugin server behind a real router on 127.0.0.1 (docs/replicas.md), with clients that send no
affinity header: later turns of concurrent conversations reuse what one server alone reuses and answer the same
(fp32, greedy); a replica killed mid-run costs no request more than a retryable error, never a hang; the router
takes it out and, once it is back, sends it traffic again.

Needs the routers (``make test-replicas`` installs them in .venv-router); skipped without them.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import router as routers
from support.plugin_status import wait_idle
from support.server import Server

pytestmark = [pytest.mark.server, pytest.mark.replicas,
              pytest.mark.skipif(not routers.installed(routers.SGLANG), reason="no router: make test-replicas installs it")]

FLAGS = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "8", "--prefill-step-size", "64")
# The docs' flags for OpenAI-API clients (docs/replicas.md); the tests check health every second (support/router.py).
SGLANG_FLAGS = ("--policy", "cache_aware", "--cb-timeout-duration-secs", "10")
# The docs' flags for Anthropic-API clients.
VLLM_FLAGS = ("--policy", "consistent_hash", "--cb-timeout-duration-secs", "10")
SYSTEM = "You are a coding agent. Use the tools when they help. " * 4
_WORDS = ("parser config scheduler token batch prefill decode cache snapshot router replica stream request engine model "
          "layer kernel tensor queue budget").split()


def conversations(seed: int, count: int = 4) -> list[list[str]]:
    """Per conversation, three user turns: a pasted file, then two shorter asks (each its own text)."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(words))

    return [[f"Here is file {i}: {text(120)}", f"Now change it: {text(60)}", f"And the test: {text(60)}"] for i in range(count)]


async def converse(client: httpx.AsyncClient, model: str, turns: list[str], max_tokens: int = 24,
                   headers: dict[str, str] | None = None) -> list[tuple[str, int]]:
    """Each turn's answer and cached prompt tokens; the answer goes back into the next turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        response = await client.post("/v1/chat/completions", json=body, headers=headers or {})
        assert response.status_code == 200, response.text
        result = response.json()
        answer = result["choices"][0]["message"]["content"]
        out.append((answer, int((result["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)))
        messages.append({"role": "assistant", "content": answer})
    return out


def run_conversations(url: str, model: str, convs: list[list[str]]) -> list[list[tuple[str, int]]]:
    async def run() -> list[list[tuple[str, int]]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return list(await asyncio.gather(*(converse(client, model, c) for c in convs)))

    return asyncio.run(run())


def later_cached(results: list[list[tuple[str, int]]]) -> int:
    return sum(cached for conv in results for _, cached in conv[1:])


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture
def two_replicas(tiny_vlm_fp32: Path, logs: Path) -> Iterator[list[Server]]:
    with ExitStack() as stack:
        yield [stack.enter_context(routers.replica(tiny_vlm_fp32, FLAGS, logs)) for _ in range(2)]


def test_conversations_keep_their_replica_without_an_affinity_header(tiny_vlm_fp32: Path, two_replicas: list[Server],
                                                                      logs: Path) -> None:
    convs = conversations(seed=7)
    with routers.replica(tiny_vlm_fp32, FLAGS, logs) as alone:
        expected = run_conversations(alone.url, alone.model, convs)
    with routers.route(routers.SGLANG, [r.url for r in two_replicas], *SGLANG_FLAGS, log_dir=logs) as router:
        got = run_conversations(router.url, two_replicas[0].model, convs)
    served = [routers.prefix_lookups(r) for r in two_replicas]
    print(f"later-turn cached tokens: {later_cached(got)} through the router, {later_cached(expected)} on one server; "
          f"requests per replica {served}")
    assert [[a for a, _ in c] for c in got] == [[a for a, _ in c] for c in expected]  # fp32, greedy: the same answers
    assert later_cached(expected) > 0 and later_cached(got) >= 0.9 * later_cached(expected)
    assert sum(served) == 12


async def _request(client: httpx.AsyncClient, model: str, i: int, stream: bool, first: asyncio.Event) -> str:
    """How one request ended: 'complete', 'status N' (a refusal), 'error event N', 'connection error'."""
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"story {i}"}],
            "max_tokens": 300, "temperature": 0.0, "stream": stream}
    try:
        if not stream:
            response = await client.post("/v1/chat/completions", json=body)
            return "complete" if response.status_code == 200 else f"status {response.status_code}"
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return f"status {response.status_code}"
            lines = [line async for line in _lines(response, first)]
        if lines[-1:] != ["data: [DONE]"]:
            return "truncated"  # an end without its terminal: what clients must never get
        last = json.loads(lines[-2][6:])
        return f"error event {last['error']['code']}" if "error" in last else "complete"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
        return "connection error"


async def _lines(response: httpx.Response, first: asyncio.Event) -> Any:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            first.set()
            yield line


def _kill_mid_run(url: str, model: str, victim_of: Any, sig: int) -> list[str]:
    """Eight requests (half streamed) through the router; ``sig`` to the replica serving most of them once they run."""
    async def run() -> list[str]:
        first = asyncio.Event()
        # a read timeout is a hang: it fails the test
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, read=60)) as client:
            tasks = [asyncio.create_task(_request(client, model, i, i % 2 == 0, first)) for i in range(8)]
            await first.wait()
            await asyncio.sleep(0.2)
            victim_of().proc.send_signal(sig)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(run())


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_replica_killed_mid_run(tiny_vlm_fp32: Path, logs: Path, sig: int) -> None:
    with ExitStack() as stack:
        replicas = [stack.enter_context(routers.replica(tiny_vlm_fp32, (*FLAGS, "--drain-timeout", "1"), logs))
                    for _ in range(2)]
        router = stack.enter_context(routers.route(routers.SGLANG, [r.url for r in replicas], *SGLANG_FLAGS, log_dir=logs))

        def busiest() -> Server:
            running = [r.get("/v1/status", timeout=5).json()["plugins"]["mtp-routing"]["text_engine"]["running"] for r in replicas]
            return replicas[running.index(max(running))]

        victim_box: list[Server] = []

        def victim() -> Server:
            victim_box.append(busiest())
            return victim_box[0]

        outcomes = _kill_mid_run(router.url, replicas[0].model, victim, sig)
        dead = victim_box[0]
        survivor = next(r for r in replicas if r is not dead)
        print(f"{signal.Signals(sig).name}: {outcomes}")
        allowed = {"complete", "status 503", "error event 503"} if sig == signal.SIGTERM else {"complete", "connection error"}
        assert set(outcomes) <= allowed and "complete" in outcomes
        assert dead.proc.wait(timeout=60) is not None
        assert wait_idle(survivor, within=30) <= 30
        router.wait_workers({dead.url: False, survivor.url: True}, within=30)

        port = int(dead.url.rsplit(":", 1)[1])
        back = stack.enter_context(routers.replica(tiny_vlm_fp32, FLAGS, logs, port=port))
        router.wait_workers({dead.url: True, survivor.url: True}, within=30)
        before = routers.prefix_lookups(back)
        t0 = time.monotonic()
        rounds = 0
        while routers.prefix_lookups(back) == before:  # new conversations until one lands there (the router's own pace)
            assert time.monotonic() - t0 < 120, f"the replica that came back got no request in 120 s:\n{router.log()[-3000:]}"
            run_conversations(router.url, back.model, conversations(seed=11 + rounds, count=4))
            rounds += 1
        print(f"after the restart: {routers.prefix_lookups(back) - before} requests on the replica that came back, "
              f"{time.monotonic() - t0:.1f} s after it was healthy ({rounds} rounds of 4 conversations)")


async def converse_anthropic(client: httpx.AsyncClient, model: str, turns: list[str], metadata: dict[str, str],
                             headers: dict[str, str]) -> list[tuple[str, int]]:
    """As ``converse``, on /v1/messages with what Claude Code sends along (``metadata.user_id``)."""
    messages: list[dict[str, Any]] = []
    out = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        body = {"model": model, "system": SYSTEM, "messages": messages, "max_tokens": 24, "temperature": 0.0, "metadata": metadata}
        response = await client.post("/v1/messages", json=body, headers=headers)
        assert response.status_code == 200, response.text
        result = response.json()
        answer = "".join(block.get("text", "") for block in result["content"])
        out.append((answer, int(result["usage"].get("cache_read_input_tokens") or 0)))
        messages.append({"role": "assistant", "content": answer or "ok"})
    return out


def run_anthropic(url: str, model: str, convs: list[list[str]], header: bool) -> list[list[tuple[str, int]]]:
    async def run() -> list[list[tuple[str, int]]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return list(await asyncio.gather(*(
                # Claude Code's metadata (2.1.78 on): a JSON string whose session_id the router's body scan cannot see
                converse_anthropic(client, model, c, {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "",
                                                                             "session_id": f"session-{i}"})},
                                   {"x-session-id": f"session-{i}"} if header else {})
                for i, c in enumerate(convs))))

    return asyncio.run(run())


@pytest.mark.skipif(not routers.installed(routers.VLLM), reason="no vllm-router: make test-replicas installs it")
def test_anthropic_conversations_behind_vllm_router(tiny_vlm_fp32: Path, two_replicas: list[Server], logs: Path) -> None:
    sets = {True: conversations(seed=5), False: conversations(seed=6)}  # with the header, then without: each its own texts
    with routers.replica(tiny_vlm_fp32, FLAGS, logs) as alone:
        alone_results = {header: run_anthropic(alone.url, alone.model, convs, header=False) for header, convs in sets.items()}
    with routers.route(routers.VLLM, [r.url for r in two_replicas], *VLLM_FLAGS, log_dir=logs) as router:
        shares = []
        for header, convs in sets.items():
            expected = alone_results[header]
            before = [routers.prefix_lookups(r) for r in two_replicas]
            got = run_anthropic(router.url, two_replicas[0].model, convs, header)
            shares.append([routers.prefix_lookups(r) - b for r, b in zip(two_replicas, before)])
            print(f"/v1/messages, x-session-id {'sent' if header else 'not sent'}: later-turn cached tokens {later_cached(got)} "
                  f"through the router, {later_cached(expected)} on one server; requests per replica {shares[-1]}")
            assert [[a for a, _ in c] for c in got] == [[a for a, _ in c] for c in expected]
            assert later_cached(got) >= 0.9 * later_cached(expected)
    assert 0 in shares[1]  # without the header every conversation lands on one replica: its cache, not the pair's
