"""MTP acceptance of the trained tiny model's conversions, served through the real server.

Each (layout, precision) is made the way users make it (benchmarks use the project's checkpoint_variants:
raw-HF export, then mlx-vlm's own convert with --mtp and the head placed per layout), served with
`--plugins mtp-routing --continuous-batching --mllm --enable-mtp --mtp-schedule always` (every step drafts,
so acceptance covers every token), and sent the serving benchmark's 8 chat prompts one at a time, greedy.
Acceptance is `/v1/status` plugins.mtp-routing.mtp.acceptance_rate after them; each output is also
checked against the same model served without MTP (the `none` layout of the same conversion).

    python benchmarks/quantized_acceptance.py --precisions bf16,8bit,4bit --layouts drafter,subdir \
        --out benchmarks/results/quantized_acceptance_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from any directory
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*
sys.path.insert(0, str(REPO / "benchmarks"))
from serve_bench import PROMPTS, messages_for  # noqa: E402

from support.checkpoint_variants import LAYOUTS, PRECISIONS, variant  # noqa: E402
from support.server import serve  # noqa: E402

TRAINED = REPO / "models" / "tiny-qwen35-trained"
FLAGS = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm")


def run_prompts(url: str, model: str, max_tokens: int) -> list[str]:
    outs = []
    for i in range(len(PROMPTS)):
        body = {"model": model, "messages": messages_for(i, False), "max_tokens": max_tokens, "temperature": 0.0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        outs.append(r.json()["choices"][0]["message"]["content"])
    return outs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="8bit")
    ap.add_argument("--layouts", default="drafter")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--work", type=Path, default=None, help="where the conversions are built (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="quantized_acceptance."))
    rows = []
    for precision in a.precisions.split(","):
        if precision not in PRECISIONS:
            ap.error(f"--precisions: {precision!r} not in {sorted(PRECISIONS)}")
        base = variant(work, TRAINED, "none", precision)
        with serve(base.model, *FLAGS, log_dir=work) as server:
            plain = run_prompts(server.url, server.model, a.max_tokens)
        for layout in a.layouts.split(","):
            if layout not in LAYOUTS or layout == "none":
                ap.error(f"--layouts: {layout!r} not one of {[x for x in LAYOUTS if x != 'none']}")
            v = variant(work, TRAINED, layout, precision)
            flags = (*FLAGS, "--enable-mtp", "--mtp-schedule", "always", *v.serve_flags())
            with serve(v.model, *flags, log_dir=work) as server:
                outs = run_prompts(server.url, server.model, a.max_tokens)
                mtp = httpx.get(f"{server.url}/v1/status").json()["plugins"]["mtp-routing"]["mtp"]
            row = {"precision": precision, "layout": layout, "drafted": mtp["drafted"], "accepted": mtp["accepted"],
                   "acceptance_rate": round(mtp["acceptance_rate"], 4), "equal_to_plain": outs == plain}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"model": "models/tiny-qwen35-trained", "prompts": len(PROMPTS), "max_tokens": a.max_tokens,
              "schedule": "always", "k": 1, "machine": f"{platform.machine()} {platform.system()} CPU (MLX CPU backend)",
              "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
