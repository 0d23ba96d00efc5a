#!/usr/bin/env python3
"""The text engine's start-up warm-up on this device: what it costs, and the first and second decode step at each
batch size after it (or without it, --warmup off), through the engine's own scheduler and MTP decoding.

A process starts as a server does: the model (random weights at a Qwen3.5 shape, or the trained tiny model), the
prefill calibration (``prefill_budget.calibrate``), then ``TextEngine.warm_up`` (text_engine/warmup.py: throwaway
rows at batch sizes 1..min(--max-batch, 8), a plain step and with MTP a verify of --mtp-k drafts at each). Then, per
--prompt-tokens length, a batch grows from 1 to --max-batch rows, one row joining per size as requests do; at each
size a plain step (the one the row joins in) and a verify, then both again: the first of each kind against the
second. Sizes past the warm-up's 8 show what a larger --max-num-seqs still pays; the longer prompts show whether a
row's KV span (attention plans are per span on CUDA) needs warming too. The cold first steps without the engine
measured 2-12 s per batch size on an H100 (BENCHMARKS.md section 7; that script, first_steps.py, was removed).

MLX's CUDA backend keeps the PTX it compiles on disk (MLX_PTX_CACHE_DIR, default <temp dir>/mlx/<version>/ptx) and
reads it back in later processes: --fresh-ptx-cache points it at an empty folder (a cold start),
--ptx-cache-dir DIR at a chosen one (a second run with the same DIR is a warm start); the result records the folder
and how many files it held before and after. A process keeps what it compiled in memory: one run per process.

  python benchmarks/warmup_steps.py --shape 2b --fresh-ptx-cache --out warmup_steps-cold-gpu.json   # a GPU
  python benchmarks/warmup_steps.py --shape small --max-batch 3 --prompt-tokens 8,40 --out /tmp/w.json   # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PTX_ENV = "MLX_PTX_CACHE_DIR"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2b", choices=["trained", "2b", "small"])
    ap.add_argument("--dtype", default=None, help="default: float32 for the trained model, bfloat16 otherwise")
    ap.add_argument("--max-batch", type=int, default=10, help="the engine's max_num_seqs; batch sizes measured 1..N")
    ap.add_argument("--warmup", choices=["on", "off"], default="on")
    ap.add_argument("--mtp-k", type=int, default=1, help="draft tokens of the MTP verify (0: plain decoding only)")
    ap.add_argument("--prompt-tokens", default="16,300", help="comma-separated prompt lengths, one growing batch each")
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument("--fresh-ptx-cache", action="store_true", help=f"{PTX_ENV} = a new empty folder (cold)")
    cache.add_argument("--ptx-cache-dir", type=Path, help=f"{PTX_ENV} = this folder (created if missing)")
    ap.add_argument("--out", type=Path)
    return ap.parse_args()


def ptx_cache(a: argparse.Namespace) -> tuple[Path, str]:
    """The folder MLX's CUDA backend keeps compiled PTX in for this process, and what chose it. Set before MLX
    compiles anything (it reads the variable once)."""
    if a.fresh_ptx_cache:
        os.environ[PTX_ENV] = tempfile.mkdtemp(prefix="mlx-ptx-")
        return Path(os.environ[PTX_ENV]), "--fresh-ptx-cache"
    if a.ptx_cache_dir is not None:
        a.ptx_cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ[PTX_ENV] = str(a.ptx_cache_dir.resolve())
        return Path(os.environ[PTX_ENV]), "--ptx-cache-dir"
    if os.environ.get(PTX_ENV):
        return Path(os.environ[PTX_ENV]), PTX_ENV
    import mlx.core as mx

    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx", "MLX's default"


def files_in(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def load(shape: str, dtype: str | None):
    """(model, MTP head, tokenizer, vocabulary ids to draw prompts from, provenance) as the engine builds them."""
    import mlx.core as mx

    from vllm_mlx_mtp_routing.model.kernels.swaps import use_grouped_attention

    if shape == "trained":
        import mtp_decode_bench as mb

        _, bundle, tok, _ = mb.load_bundle(None)  # build_text_model: the engine's own model
        return bundle.model, bundle.mtp, tok, len(tok) - 1, {"model": "models/tiny-qwen35-trained"}
    import mtp_shapes_bench as sb

    tok, tok_size, special = sb.load_tokenizer()
    cfg = sb.SHAPES[shape]
    t0 = time.perf_counter()
    model, head, n_params, _ = sb.build(cfg, getattr(mx, dtype or "bfloat16"), sorted(set(range(tok_size, cfg["vocab_size"])) | set(special)))
    use_grouped_attention(model)  # as build_text_model (the rest of its wiring is in sb.build)
    use_grouped_attention(head)
    info = {"model": f"{shape}-shaped, random {dtype or 'bfloat16'} weights, built in memory", "params": n_params,
            "build_s": round(time.perf_counter() - t0, 1), "text_config": {**sb.COMMON, **cfg}}
    return model, head, tok, tok_size - 1, info


def summarize(results: list[dict], kinds: tuple[str, ...]) -> dict:
    """Per prompt length and kind: the slowest first step (decode seconds) at batch sizes the warm-up covered and at
    the others, against the slowest second step."""
    out: dict = {}
    for entry in results:
        for kind in kinds:
            first, second = (s["decode_s"] for s in entry[kind])
            slot = out.setdefault(str(entry["prompt_tokens"]), {}).setdefault(kind, {})
            key = "first_warmed_max_s" if entry["warmed"] else "first_not_warmed_max_s"
            slot[key] = max(slot.get(key, 0.0), first)
            slot["second_max_s"] = max(slot.get("second_max_s", 0.0), second)
    return out


def main() -> None:
    a = parse()
    cache_dir, cache_source = ptx_cache(a)
    cache_before = files_in(cache_dir)

    import mlx.core as mx
    import numpy as np

    import provenance
    from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
    from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
    from vllm_mlx_mtp_routing.text_engine.engine import TextEngine
    from vllm_mlx_mtp_routing.text_engine.state import TextRequest
    from vllm_mlx_mtp_routing.text_engine import warmup
    from vllm_mlx_mtp_routing.text_engine.prefill_budget import DEFAULT_RATIO, calibrate

    started = time.perf_counter()
    model, head, tok, top_id, info = load(a.shape, a.dtype or ("float32" if a.shape == "trained" else None))
    policy = warmup.ScriptedDrafts(a.mtp_k) if a.mtp_k else None
    decode = MTPDecode(head, k=a.mtp_k, policy=policy) if a.mtp_k else None
    engine = TextEngine(model, tok, max_num_seqs=a.max_batch, prefill_step_size=a.prefill_step_size, decode=decode)
    sched = engine.scheduler
    sched.eos_ids = set()  # rows run until dropped

    # As a server starts: the prefill calibration (its probes are the process's first steps), then the warm-up.
    budget = calibrate(model, max_chunk=a.prefill_step_size, ratio=DEFAULT_RATIO, vocab_size=top_id + 1)
    budget.apply(sched)
    warm = None
    if a.warmup == "on":
        if policy is not None:
            policy.drafting = True  # the warm-up verifies where the server's policy could draft: everywhere here
        warm = engine.warm_up().stats()
        print(json.dumps({"warmup": warm}), flush=True)

    # Each step's record (its decode, prefill and join seconds) as the scheduler's profile hands it out.
    records = []
    begin = sched.profile.begin

    def recording_begin(step: int):
        records[:] = [begin(step)]
        return records[0]

    sched.profile.begin = recording_begin

    def step(kind: str) -> dict:
        if policy is not None:
            policy.drafting = kind == "verify"
        tic = time.perf_counter()
        sched.step()
        mx.synchronize()
        record = records[0]
        return {"step_s": round(time.perf_counter() - tic, 4), "decode_s": round(record.decode_s, 4),
                "prefill_s": round(record.prefill_s, 4), "join_s": round(record.join_s, 4)}

    rng = np.random.default_rng(0)
    kinds = ("plain", "verify") if a.mtp_k else ("plain",)
    results = []
    for length in [int(n) for n in a.prompt_tokens.split(",")]:
        for B in range(1, a.max_batch + 1):
            sched.add(TextRequest(f"{length}-{B}", rng.integers(1, top_id, size=length).tolist(),
                                  SamplingOptions(max_tokens=1 << 30)))
            entry: dict = {"batch": B, "prompt_tokens": length, "warmed": warm is not None and B in warm["batch_sizes"]}
            while len(sched.running) < B:  # the row's prefill and join; its last step decodes the B rows: plain
                first = step("plain")
            entry["plain"] = [first]
            for kind in kinds[1:]:
                entry[kind] = [step(kind)]
            for kind in kinds:
                entry[kind].append(step(kind))
            results.append(entry)
            print(json.dumps({"batch": B, "prompt_tokens": length,
                              **{k: [s["decode_s"] for s in entry[k]] for k in kinds}}), flush=True)
        for row in reversed(list(sched.running)):
            sched.abort(row.rid)

    out = {
        "summary": summarize(results, kinds),
        "benchmark": "warmup_steps", **provenance.record(), "model": info,
        "config": {"warmup": a.warmup, "max_batch": a.max_batch, "mtp_k": a.mtp_k, "prompt_tokens": a.prompt_tokens,
                   "prefill_step_size": a.prefill_step_size, "warmup_max_batch": warmup.MAX_BATCH},
        "ptx_cache": {"dir": str(cache_dir), "set_by": cache_source, "files_before": cache_before,
                      "files_after": files_in(cache_dir), "warm": cache_before > 0},
        "calibration": budget.stats(), "warmup": warm, "results": results,
        "mtp": decode.stats() if decode is not None else None,  # steps_with_mtp: the verifies that ran
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps({k: out[k] for k in ("ptx_cache", "warmup", "summary", "seconds")}), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
