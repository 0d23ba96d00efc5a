#!/usr/bin/env python3
"""The prefix cache's disk tier: is reading a snapshot back faster than prefilling it again?

For each prompt length, on the text engine (``BatchScheduler``, greedy, max_tokens 1, the prompt in
--prefill-step-size chunks), alternating, median of --repeats:
  recompute   no cache: the whole prompt prefilled, then the first token;
  reload      the prompt's end-of-prompt snapshot on disk only (evicted from memory, spilled to
              --dir): the file read, the caches restored, the first token.
Both return the same first token (checked). The file's size and the read's share of the reload are
recorded. Reads hit the OS page cache after the first; a cold read (caches dropped, where the
process may) is recorded too.

  python benchmarks/ssd_reload.py --model models/tiny-qwen35-trained --lengths 1024,4096 --out /tmp/ssd_cpu.json
  python benchmarks/ssd_reload.py --model /root/qwen35-2b --lengths 4096,16384 --out $OUT/ssd_reload-gpu.json   # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import commit, device, versions  # noqa: E402


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="the disk tier's directory (default: a temporary one)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)

    import mlx.core as mx
    from mlx_vlm import load

    from specprefill_speed import prompt_ids
    from vllm_mlx_mtp_routing.prefix_cache.cache import PrefixCache
    from vllm_mlx_mtp_routing.prefix_cache.disk_tier import DiskTier
    from vllm_mlx_mtp_routing.model.weights_fingerprint import fingerprint
    from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
    from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
    from vllm_mlx_mtp_routing.text_engine.state import TextRequest
    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    vlm, processor = load(str(a.model))
    model = build_text_model(vlm, a.model, json.loads((a.model / "config.json").read_text()), enable_mtp=False).model
    tok = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    root = a.dir or Path(tempfile.mkdtemp(prefix="ssd-reload-"))
    disk = DiskTier(root, 10**12, fingerprint(model))

    def first_token(prompt: list[int], cache) -> tuple[float, int, int]:
        sched = BatchScheduler(model, tok, prefill_step_size=a.prefill_step_size, prefix_cache=cache)
        tic = time.perf_counter()
        sched.add(TextRequest("r", prompt, SamplingOptions(max_tokens=1)))
        while sched.has_work():
            for o in sched.step():
                if o.finished:
                    return time.perf_counter() - tic, o.token_ids[0], o.cached_tokens
        raise RuntimeError("no first token")

    result = {"benchmark": "ssd_reload", "model": str(a.model), "commit": commit(), "device": device(),
              "versions": versions(), "prefill_step_size": a.prefill_step_size, "points": []}
    for n in (int(x) for x in a.lengths.split(",")):
        prompt = prompt_ids(tok, n, True, seed=n)
        cache = PrefixCache(model, 64 << 30, disk=disk)
        first_token(prompt, cache)  # leaves its end-of-prompt snapshot in memory
        cache.tree.evict_to(0)  # ... now on disk only
        recompute, reload, reads = [], [], []
        first_token(prompt, None)  # warm-up of the dense path at this length
        for _ in range(a.repeats):
            t, tok_dense, _ = first_token(prompt, None)
            recompute.append(t)
            fresh = PrefixCache(model, 64 << 30, disk=disk)  # memory empty, as after a restart or an eviction
            before = disk.read_s
            t, tok_reload, cached = first_token(prompt, fresh)
            reads.append(disk.read_s - before)
            reload.append(t)
            if tok_reload != tok_dense or cached != len(prompt) - 1:
                raise RuntimeError(f"reload gave token {tok_reload} (cached {cached}), dense {tok_dense}")
        cold = None
        if drop_page_cache():
            fresh = PrefixCache(model, 64 << 30, disk=disk)
            cold = first_token(prompt, fresh)[0]
        size = sum(p.stat().st_size for p in disk.dir.glob("*.safetensors"))
        point = {"tokens": len(prompt), "recompute_s": round(statistics.median(recompute), 4),
                 "reload_s": round(statistics.median(reload), 4), "read_s": round(statistics.median(reads), 4),
                 "reload_cold_s": round(cold, 4) if cold is not None else None,
                 "speedup": round(statistics.median(recompute) / statistics.median(reload), 2),
                 "files_bytes": size}
        result["points"].append(point)
        print(json.dumps(point), flush=True)
        for p in disk.dir.glob("*.safetensors"):
            p.unlink()
        disk = DiskTier(root, 10**12, fingerprint(model))
        mx.clear_cache()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
