"""The plugin server several e2e modules share (conftest.SHARED_SERVER_UNITS), and the counters every one of its
tests ends with at 0: no request may leak an admission slot or a text-engine row."""

from __future__ import annotations

import time
from typing import Any

from .server import Server

# bf16 tiny model, four rows, small prefill chunks: what test_reliability_e2e and the malformed-input modules run on.
SHARED_FLAGS = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "4", "--prefill-step-size", "64")


def plugin_status(server: Server) -> dict[str, Any]:
    return server.get("/v1/status", timeout=10).json()["plugins"]["mtp-routing"]


def counters(server: Server) -> tuple[int, ...]:
    """Admission running, queued and reserved bytes; the text engine's running, prefilling and waiting rows."""
    s = plugin_status(server)
    a, t = s["admission"], s["text_engine"]
    return a["running"], a["queued"], a["reserved_bytes"], t["running"], t["prefilling"], t["waiting"]


def wait_idle(server: Server, within: float) -> float:
    """Seconds until every counter is 0; fails after ``within``."""
    t0 = time.monotonic()
    while True:
        c = counters(server)
        if c == (0,) * 6:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within, f"counters not back to 0 after {within}s: {c}"
        time.sleep(0.05)
