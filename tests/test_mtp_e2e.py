"""MTP on the text path through the real server, with the trained tiny model (its head really accepts)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from support.server import Server, serve

pytestmark = pytest.mark.server

TRAINED = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen35-trained"
# test_logits_processing_e2e's flags: its servers with and without MTP are this module's too (shared_server)
FLAGS = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "4", "--prefill-step-size", "32")
# every step drafting, and the head over only the prompts' last 4 positions: the prefill's first chunk runs without
# it, the head starts at a later position (and must keep the output exact)
MTP_ALWAYS = ("--enable-mtp", "--mtp-schedule", "always", "--mtp-prompt-pairs", "4")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\ndef main(argv=None):\n    parser = ", "class Stack:\n    def __init__(self):"]


def greedy(server: Server) -> list[str]:
    outs = []
    for prompt in PROMPTS:
        body = {"model": server.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
        outs.append(server.post("/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]["content"])
    return outs


def test_mtp_output_equals_plain_and_drafts_are_accepted(tmp_path: Path, shared_server: Callable[..., Server]) -> None:
    with serve(TRAINED, *FLAGS, "--enable-mtp", log_dir=tmp_path) as server:
        with_mtp = greedy(server)
        status = server.get("/v1/status").json()
        mtp = status["plugins"]["mtp-routing"]["mtp"]
        # the host's own status block tells the same story: MTP runs on the text path
        assert status["mtp"]["path"] == "text" and status["mtp"]["drafted"] == mtp["drafted"]
    server = shared_server(TRAINED, *FLAGS, *MTP_ALWAYS)
    before = server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"]
    always = greedy(server)
    after = server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"]
    fixed = {k: after[k] - before[k] for k in ("drafted", "accepted", "steps_with_mtp", "steps_without_mtp")}  # a shared server
    assert "head over the prompt's last 4 positions" in server.log()
    server = shared_server(TRAINED, *FLAGS)
    without = greedy(server)
    assert server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"] == {"enabled": False}
    assert with_mtp == without == always
    assert after["adaptive"] is False and fixed["steps_with_mtp"] > fixed["steps_without_mtp"]
    assert fixed["accepted"] > 0.5 * fixed["drafted"]  # the trained head (0.87 held-out) really drafts
    # adaptive MTP drafts at least while it measures what drafting costs at each batch size
    assert mtp["drafted"] > 0 and mtp["steps_with_mtp"] > 0
    assert mtp["accepted"] > 0
    assert set(mtp) >= {"drafted", "accepted", "acceptance_rate", "steps_with_mtp", "steps_without_mtp"}
