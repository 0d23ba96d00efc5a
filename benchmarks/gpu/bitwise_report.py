"""How the GPU's bitwise checks (conv_step_check.py, add_norm_check.py) report: every case to a JSON file, one line."""

from __future__ import annotations

import json
from pathlib import Path


def report(check: str, rows: list[dict], must_hold: tuple[str, ...], out: str) -> int:
    """Write the cases and the ones where any of ``must_hold`` is false; print the count; 1 where any failed."""
    bad = [r for r in rows if not all(r[key] for key in must_hold)]
    Path(out).write_text(json.dumps({"check": check, "cases": len(rows), "failed": bad, "rows": rows}, indent=1))
    print(f"{check}_check: {len(rows) - len(bad)} of {len(rows)} cases bitwise equal" + (f"; failed: {bad[:4]}" if bad else ""))
    return 1 if bad else 0
