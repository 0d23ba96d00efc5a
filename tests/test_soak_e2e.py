"""A short soak through the real server (scripts/soak.py; the full run is 1000 requests, BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[1]


def test_short_soak_ends_clean(tiny_vlm_bf16: Path) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "soak.py"), "--model", str(tiny_vlm_bf16), "--requests", "48",
           "--concurrency", "6", "--rss-tolerance", "0.5"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["status_500"] == 0 and summary["unexpected_count"] == 0, summary["unexpected"]
    assert not any(summary["final_counters"].values()) and summary["health"] == 200
    assert out.returncode == 0 and summary["pass"], summary
