#!/usr/bin/env python3
"""Same-run A/B of plain (no MTP) decode throughput between two checkouts of this project.

Each round runs one child process per checkout (order alternating between rounds), each child
importing the package from its own checkout and decoding B prompts greedily with the scheduler's
plain decode (decode steps only, prefill excluded) at every batch size. A ratio is the median
over rounds of (tok/s of --new) / (tok/s of --base) in the same round, so a slow phase of a shared
machine weighs on both.

  python benchmarks/plain_ab.py --base ../other-checkout --rounds 5 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CHILD = r"""
import json, sys, time
# the installed package's start-up hook imported it already: import it again from the checkout given
for m in [m for m in sys.modules if m.startswith("vllm_mlx_mtp_routing")]:
    del sys.modules[m]
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/benchmarks")
import vllm_mlx_mtp_routing
assert vllm_mlx_mtp_routing.__file__.startswith(sys.argv[1]), vllm_mlx_mtp_routing.__file__
import mtp_decode_bench as mb
from vllm_mlx_mtp_routing.text_engine.decode import SingleTokenDecode
_, bundle, tok, _ = mb.load_bundle(None)
batches, plen, ntok = [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
prompts = mb.make_prompts(tok, max(batches), plen)
mb.run(bundle, tok, prompts[:1], 8, SingleTokenDecode())  # warm-up
out = {}
for B in batches:
    _, timed = mb.run(bundle, tok, prompts[:B], ntok, SingleTokenDecode())
    out[B] = timed.tokens / timed.seconds
print(json.dumps(out))
"""


def child(root: Path, batches: str, plen: int, ntok: int) -> dict[int, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", CHILD, str(root), batches, str(plen), str(ntok)],
                         capture_output=True, text=True, env=env, check=True)
    return {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (the baseline)")
    ap.add_argument("--new", type=Path, default=ROOT)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    rows = []
    for r in range(a.rounds):
        order = [("base", a.base), ("new", a.new)] if r % 2 == 0 else [("new", a.new), ("base", a.base)]
        got = {name: child(root, a.batches, a.prompt_tokens, a.max_tokens) for name, root in order}
        rows.append(got)
        print(f"round {r}: " + "  ".join(f"B={B} {got['new'][B] / got['base'][B]:.3f}" for B in got["new"]), flush=True)
    result = {"rounds": rows, "ratio_median": {}}
    for B in rows[0]["new"]:
        ratios = [g["new"][B] / g["base"][B] for g in rows]
        result["ratio_median"][B] = statistics.median(ratios)
        print(f"B={B}: new/base median {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}); "
              f"base {statistics.median(g['base'][B] for g in rows):.0f} tok/s")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
