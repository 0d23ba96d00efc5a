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

MTP_FORCE_ACCEPTANCE=A makes the text path's verify agree with each draft with probability A (greedy rows; the test
support's ForcedAcceptance): a model with random weights has a head the backbone never agrees with, so this is how a
benchmark measures MTP's machinery at a realistic acceptance on a realistic shape. The server reports it as measured.
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


def force_acceptance(rate: float) -> None:
    """Every MTPDecode the server builds accepts with ``rate`` (patched on the class, before the engine exists)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
    from support.forced_acceptance import ForcedAcceptance
    from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode

    init = MTPDecode.__init__

    def forced_init(self, head, *args, **kwargs):
        kwargs.setdefault("acceptance", ForcedAcceptance(rate))
        init(self, head, *args, **kwargs)

    MTPDecode.__init__ = forced_init


def main(argv: list[str]) -> int:
    rest = list(argv)
    while len(rest) >= 2 and rest[0] == "--site":
        site.addsitedir(rest[1])
        rest = rest[2:]
    # imported only now: the bootstrap's hook must be armed before vllm_mlx.cli loads
    from vllm_mlx.cli import main as vllm_mlx_main

    if os.environ.get("MTP_STEP_TRACE"):
        trace_mtp_steps(os.environ["MTP_STEP_TRACE"])
    if os.environ.get("MTP_FORCE_ACCEPTANCE"):
        force_acceptance(float(os.environ["MTP_FORCE_ACCEPTANCE"]))

    sys.argv = ["vllm-mlx", *rest]
    return vllm_mlx_main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
