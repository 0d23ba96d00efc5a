"""How the GPU's bitwise checks (conv_step_check.py) report: every case to a JSON file, one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_mlx_mtp_routing.model.kernels.device import on_cuda


def output_path(check: str, doc: str | None, argv: list[str] | None) -> str | None:
    """The check's ``--out``; None (said on stdout) on a machine without CUDA, where there is nothing to check."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--out", required=True)
    out: str = ap.parse_args(argv).out
    if not on_cuda():
        print(f"{check}_check: no CUDA device here; nothing to check")
        return None
    return out


def report(check: str, rows: list[dict], must_hold: tuple[str, ...], out: str) -> int:
    """Write the cases and the ones where any of ``must_hold`` is false; print the count; 1 where any failed."""
    bad = [r for r in rows if not all(r[key] for key in must_hold)]
    Path(out).write_text(json.dumps({"check": check, "cases": len(rows), "failed": bad, "rows": rows}, indent=1))
    print(f"{check}_check: {len(rows) - len(bad)} of {len(rows)} cases bitwise equal" + (f"; failed: {bad[:4]}" if bad else ""))
    return 1 if bad else 0
