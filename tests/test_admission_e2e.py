"""Admission through the real server: a burst is answered by complete streams or clean 503s, never a 500."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_bridge_cli import run_cli

from support.server import Server, png_data_url, serve

pytestmark = pytest.mark.server

BURST = 24


@pytest.fixture(scope="module")
def server(tiny_vlm_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = (
        "--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "2",
        "--scheduler-max-queue", "2", "--scheduler-queue-timeout", "60", "--enable-metrics",
    )
    with serve(tiny_vlm_bf16, *flags, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


async def one_stream(client: httpx.AsyncClient, model: str, i: int) -> tuple[int, str, dict[str, str]]:
    content: object = f"def function_{i}(x):"
    if i % 6 == 0:  # some media requests: admission gates both paths
        content = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": png_data_url((i * 10, 0, 0))}}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        text = "".join([chunk async for chunk in response.aiter_text()])
        return response.status_code, text, dict(response.headers)


def admission_stats(server: Server) -> dict:
    return server.get("/v1/status").json()["plugins"]["mtp-routing"]["admission"]


def test_burst_gets_complete_streams_or_503(server: Server) -> None:
    async def burst() -> list[tuple[int, str, dict[str, str]]]:
        async with server.async_client(timeout=180) as client:
            return await asyncio.gather(*(one_stream(client, server.model, i) for i in range(BURST)))

    results = asyncio.run(burst())
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 4  # two running plus two queued always get through
    assert statuses.count(503) >= 1  # 24 at once over 2 running + 2 queued must overflow
    for status, text, headers in results:
        if status == 200:
            assert text.rstrip().endswith("data: [DONE]")
            assert '"finish_reason":"length"' in text.replace(" ", "") or '"finish_reason":"stop"' in text.replace(" ", "")
            assert '"error"' not in text
        else:
            assert int(headers["retry-after"]) >= 1
            assert json.loads(text)["error"]["code"] == 503

    assert server.get("/health").status_code == 200
    stats = admission_stats(server)
    assert (stats["running"], stats["queued"], stats["reserved_bytes"]) == (0, 0, 0)
    assert stats["rejected"] >= statuses.count(503)
    assert stats["policy"] == "fifo"
    metrics = server.get("/metrics").text
    assert "vllm_mlx_mtp_routing_admission" in metrics
    log = server.log()
    assert "server busy" not in "".join(line for line in log.splitlines(True) if "ERROR" in line)  # not an error
    assert "Refusing requests (queue_full)" in log  # one INFO line when the burst starts


def test_bad_priority_header_is_400(server: Server) -> None:
    response = server.post(
        "/v1/chat/completions",
        json={"model": server.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        headers={"X-Request-Priority": "high"},
        timeout=60,
    )
    assert response.status_code == 400
    assert "X-Request-Priority" in response.json()["error"]["message"]


def test_impossible_headroom_exits_2_naming_flag(tiny_vlm_bf16: Path) -> None:
    result = run_cli("serve", str(tiny_vlm_bf16), "--plugins", "mtp-routing", "--continuous-batching", "--mllm",
                     "--scheduler-headroom-gb", "100000")
    assert result.returncode == 2
    assert "argument --scheduler-headroom-gb" in result.stderr


def test_bad_policy_exits_2_naming_flag(tiny_vlm_bf16: Path) -> None:
    result = run_cli("serve", str(tiny_vlm_bf16), "--plugins", "mtp-routing", "--scheduler-policy", "random")
    assert result.returncode == 2
    assert "argument --scheduler-policy" in result.stderr


def test_long_prompt_burst_over_a_small_budget_queues_and_finishes(tiny_vlm_fp32: Path, tmp_path: Path) -> None:
    from vllm_mlx_mtp_routing.admission import MemoryModel

    prompt = "for item in collection:\n    total += process(item)\n" * 60
    flags = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "8", "--prefill-step-size", "256")
    with serve(tiny_vlm_fp32, *flags, log_dir=tmp_path) as probe:
        stats = admission_stats(probe)
        prompt_tokens = probe.post("/v1/chat/completions", timeout=120, json={
            "model": probe.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    config = json.loads((tiny_vlm_fp32 / "config.json").read_text())
    one = MemoryModel.from_model_config(config, prefill_step_size=256).project(prompt_tokens, 16)
    # Room for one such request and a half: a burst of six must queue, not fail or abort.
    budget = stats["baseline_bytes"] + int(1.6 * one)
    headroom_gb = (stats["device_bytes"] - budget) / 2**30
    with serve(tiny_vlm_fp32, *flags, "--scheduler-headroom-gb", f"{headroom_gb:.6f}", log_dir=tmp_path) as server:
        async def burst() -> list[httpx.Response]:
            async with server.async_client(timeout=180) as client:
                body = {"model": server.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0}
                return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(6)))

        responses = asyncio.run(burst())
        assert [r.status_code for r in responses] == [200] * 6, [r.text[:200] for r in responses]
        assert all(r.json()["usage"]["completion_tokens"] == 16 for r in responses)
        stats = admission_stats(server)
        assert stats["queued_total"] >= 1 and stats["rejected"] == 0
        assert (stats["running"], stats["queued"], stats["reserved_bytes"]) == (0, 0, 0)
