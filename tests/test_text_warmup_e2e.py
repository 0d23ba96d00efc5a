"""--text-warmup through the real server on loopback (forced on: 'auto' is off on the CPU) and the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bridge_cli import run_cli

from support.server import serve

pytestmark = pytest.mark.server


def test_the_warm_up_is_in_status_counts_nothing_and_the_server_serves(tiny_vlm_fp32: Path, tmp_path: Path) -> None:
    flags = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--enable-mtp", "--max-num-seqs", "3",
             "--text-warmup", "on")
    with serve(tiny_vlm_fp32, *flags, log_dir=tmp_path) as server:
        status = server.get("/v1/status").json()
        plugin = status["plugins"]["mtp-routing"]
        warm = plugin["text_engine"]["warmup"]
        assert warm["batch_sizes"] == [1, 2, 3] and warm["verify_batch_sizes"] == [1, 2, 3] and warm["draft_tokens"] == 1
        assert warm["seconds"] > 0
        assert warm["snapshots"] >= 2 and warm["snapshot_hits"] >= 1  # in its throwaway cache: the server's stays empty
        assert "text decode warmed up at batch sizes 1-3 (a plain step and a 1-draft MTP verify at 1-3)" in server.log()
        engine = plugin["text_engine"]
        assert engine["steps"] == engine["tokens_generated"] == engine["prompt_tokens_processed"] == 0
        assert engine["batch_size_histogram"] == {} and engine["slowest_steps"] == [] and engine["running"] == 0
        assert plugin["mtp"]["drafted"] == plugin["mtp"]["steps_with_mtp"] == plugin["mtp"]["steps_without_mtp"] == 0
        assert plugin["prefix_cache"]["lookups"] == plugin["prefix_cache"]["entries"] == 0
        assert plugin["admission"]["admitted"] == plugin["admission"]["running"] == plugin["admission"]["reserved_bytes"] == 0
        assert status["num_running"] == status["num_waiting"] == 0

        reply = server.openai().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens >= 1

        status = server.get("/v1/status").json()
        plugin = status["plugins"]["mtp-routing"]
        engine = plugin["text_engine"]
        assert engine["tokens_generated"] == reply.usage.completion_tokens  # this request's alone
        assert engine["prompt_tokens_processed"] == reply.usage.prompt_tokens - 1  # its last token is decoded
        assert set(engine["batch_size_histogram"]) == {"1"} and plugin["routing"]["text"] == 1
        assert plugin["prefix_cache"]["lookups"] == 1
        assert engine["running"] == plugin["admission"]["running"] == plugin["admission"]["reserved_bytes"] == 0
        assert status["num_running"] == status["num_waiting"] == 0
        assert engine["warmup"] == warm


def test_a_bad_warm_up_mode_exits_2_naming_the_flag() -> None:
    result = run_cli("serve", "some-model", "--plugins", "mtp-routing", "--text-warmup", "maybe")
    assert result.returncode == 2
    assert "argument --text-warmup: invalid choice: 'maybe' (choose from" in result.stderr
