#!/usr/bin/env python3
"""`vllm-mlx` with extra site directories, for packages installed by `pip install --target DIR`.

A --target directory on PYTHONPATH is a plain path entry: Python never runs its `.pth` files, so
the plugin's bootstrap (the import hook that gives `vllm-mlx` its `--plugins` flag) stays unarmed,
and pip's console scripts in DIR/bin name whichever interpreter ran pip. This runs the `.pth` files
of each `--site DIR` (site.addsitedir), then the same entry point as the `vllm-mlx` script.

  python benchmarks/lib/vllm_mlx_launcher.py --site /root/site serve MODEL --mllm ... --plugins mtp-routing
  python benchmarks/serve_bench.py --server-cmd "python benchmarks/lib/vllm_mlx_launcher.py --site /root/site"

MTP_STEP_TRACE=FILE appends one JSON line per text-path MTP step (batch, drafts, milliseconds) and per
step the adaptive draft policy times (diagnosis of the policy inside a server).
"""

from __future__ import annotations

import json
import os
import site
import sys
import time


def trace_mtp_steps(path: str) -> None:
    """Log every text-path MTP decode step (the model runner's ``decode`` of a runner with MTP) and every step cost
    the adaptive draft policy records. Patched on the classes: the server builds its engine after this."""
    from vllm_mlx_mtp_routing.text_engine.runner import ModelRunner
    from vllm_mlx_mtp_routing.text_engine.spec.draft_costs import DraftCosts

    out = open(path, "a", buffering=1)
    decode, record = ModelRunner.decode, DraftCosts.record

    def traced_decode(self, plan):
        t = time.perf_counter()
        r = decode(self, plan)
        if self.spec is not None:
            ms = 1000 * (time.perf_counter() - t)
            out.write(json.dumps({"t": round(t, 4), "B": len(plan.rows), "k": plan.draft_tokens, "ms": round(ms, 2),
                                  "tokens": sum(map(len, r.tokens))}) + "\n")
        return r

    def traced_record(self, batch, drafted, seconds):
        out.write(json.dumps({"timed": [batch, drafted, round(1000 * seconds, 3)], "ratio": self.ratio_by_batch()}) + "\n")
        record(self, batch, drafted, seconds)

    ModelRunner.decode, DraftCosts.record = traced_decode, traced_record


def main(argv: list[str]) -> int:
    rest = list(argv)
    while len(rest) >= 2 and rest[0] == "--site":
        site.addsitedir(rest[1])
        rest = rest[2:]
    # imported only now: the bootstrap's hook must be armed before vllm_mlx.cli loads
    from vllm_mlx.cli import main as vllm_mlx_main

    if os.environ.get("MTP_STEP_TRACE"):
        trace_mtp_steps(os.environ["MTP_STEP_TRACE"])

    sys.argv = ["vllm-mlx", *rest]
    return vllm_mlx_main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
