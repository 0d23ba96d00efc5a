"""A short soak through the real server (scripts/soak.py; the full run is 1000 requests, docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[1]


def test_short_soak_ends_clean(tiny_vlm_bf16: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # The script's main in this process, so its server forks from the suite's launcher like every other one.
    spec = importlib.util.spec_from_file_location("soak", REPO / "scripts" / "soak.py")
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    monkeypatch.setattr(sys, "argv", ["soak.py", "--model", str(tiny_vlm_bf16), "--requests", "48", "--concurrency", "6",
                                      "--rss-tolerance", "0.5"])
    returncode = soak.main()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["status_500"] == 0 and summary["unexpected_count"] == 0, summary["unexpected"]
    assert not any(summary["final_counters"].values()) and summary["health"] == 200
    assert returncode == 0 and summary["pass"], summary
