"""--ssd-cache-dir through the real server on loopback: a system prompt cached by one server process
is reused by the next one started on the same directory (the reused tokens in the response's usage,
the disk tier's counters in /v1/status), with the same greedy answer as a server without any cache, and
the prefill calibration of the first reused; a bad --ssd-cache-max-gb exits 2 naming the flag."""

from __future__ import annotations

import pytest

from support.server import serve

BASE = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "2", "--prefill-step-size", "64")
SYSTEM = "You review pull requests for a storage engine. Be terse; name the file and line of each finding. " * 4


def _ask(server, question: str):
    client = server.openai()
    r = client.chat.completions.create(
        model=server.model, max_tokens=10, temperature=0.0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    )
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    return r.choices[0].message.content, cached


def _status(server) -> dict:
    with server.client() as c:
        return c.get("/v1/status").json()["plugins"]["mtp-routing"]


def _prefix_cache(server) -> dict:
    return _status(server)["prefix_cache"]


def test_a_restarted_server_reuses_the_system_prompt_from_disk(tiny_vlm_fp32, tmp_path):
    ssd = ("--ssd-cache-dir", str(tmp_path / "ssd"), "--ssd-cache-max-gb", "1")
    with serve(tiny_vlm_fp32, *BASE, *ssd, log_dir=tmp_path) as server:
        _, cached = _ask(server, "Is the WAL fsync'd before the ack?")
        assert cached == 0
        disk = _prefix_cache(server)["disk"]
        assert disk["enabled"] and disk["written"] >= 1 and disk["budget_bytes"] == 10**9
    with serve(tiny_vlm_fp32, *BASE, *ssd, log_dir=tmp_path) as server:
        assert _prefix_cache(server)["entries"] == 0  # a new process: nothing in memory
        # nor does it measure its prefill chunk again: the first server's (or an earlier one's) is reused
        assert "as measured on" in server.log() and _status(server)["prefill"]["stored_at"]
        answer, cached = _ask(server, "Does compaction hold the write lock?")
        stats = _prefix_cache(server)
        assert cached > 100 and stats["disk_hits"] == 1 and stats["disk"]["loaded"] == 1
    with serve(tiny_vlm_fp32, *BASE, "--disable-prefix-cache", log_dir=tmp_path) as server:
        assert _ask(server, "Does compaction hold the write lock?")[0] == answer
    with pytest.raises(RuntimeError, match=r"exited with 2[\s\S]*--ssd-cache-max-gb"):
        with serve(tiny_vlm_fp32, *BASE, "--ssd-cache-dir", str(tmp_path / "x"), "--ssd-cache-max-gb", "-1",
                   log_dir=tmp_path, startup_timeout=60):
            pass
