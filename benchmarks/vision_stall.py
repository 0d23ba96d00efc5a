#!/usr/bin/env python3
"""Running streams while an image request's vision tower runs: the worst gap a stream sees, the image's first token.

In one process, on a tiny Qwen3.5 VLM whose vision tower is deeper and wider than its language model (``--depth``,
``--vision-hidden``: the proportions of a real Qwen3.5, whose tower is 24-27 blocks, scaled down), the text engine
prefills as the server does (its prefill budget calibrated at start, ``--prefill-stall-ratio``'s default): ``--streams``
text rows decode, then an image request arrives. Per round, the longest step while the image prefilled (what a running
stream waited for one token) and the image's time to its first token; rounds alternate between the vision tower
in pieces of its blocks (the engine's way while rows decode) and in one call (the way before), on the same engine.

  python benchmarks/vision_stall.py --out benchmarks/results/vision_stall_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test support package: support.*
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from lib.media_engine import media_engine  # noqa: E402
from lib.provenance import commit, device_line  # noqa: E402
from mixed_load import image_url  # noqa: E402

from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions  # noqa: E402
from vllm_mlx_mtp_routing.text_engine.state import TextRequest  # noqa: E402

TRAINED = ROOT / "models" / "tiny-qwen35-trained"


def build(out: Path, depth: int, hidden: int, dtype: str) -> Path:
    """The tiny VLM with a vision tower of ``depth`` blocks of width ``hidden`` (the trained model's tokenizer)."""
    from support import tiny_model

    if not (out / "config.json").exists():
        # gated-delta heads of 32: the CUDA recurrence kernel takes key heads in multiples of 32
        tiny_model.build_tiny_qwen35_vlm(out, dtype=dtype, tokenizer_from=TRAINED, linear_head_dim=32,
                                         vision={"depth": depth, "hidden_size": hidden, "num_heads": max(hidden // 64, 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a VLM checkpoint; where the folder has none, the tiny VLM with --depth "
                    "and --vision-hidden is built there (default: a folder under the system's temporary directory)")
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--vision-hidden", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--max-pixels", type=int, default=0, help="the processor's pixel cap (0: the model's own; the tiny "
                    "VLM's is 65,536, 256 patches)")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6, help="rounds in all, the two ways alternated")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()

    def progress(what: str) -> None:  # where a run cut off by a time limit spent its time
        print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)

    path = build(a.model or Path(tempfile.gettempdir()) / f"vision-stall-vlm-{a.depth}x{a.vision_hidden}-{a.dtype}",
                 a.depth, a.vision_hidden, a.dtype)
    progress("model built")
    engine = media_engine(path, max_num_seqs=a.streams + 1, max_pixels=a.max_pixels)
    sched = engine.sched
    progress("loaded and calibrated")
    blocks = sched.runner.vision_blocks

    def image_prompt(seed: int):
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(seed, (a.image_size,) * 2)}},
                                              {"type": "text", "text": "Describe this picture."}]}]
        return engine.media_prompt(msgs)

    def one_round(r: int, pieces: bool) -> dict:
        sched.runner.vision_in_pieces = pieces
        for i in range(a.streams):
            sched.add(TextRequest(f"t{r}-{i}", [100 + (7 * k + i + r) % 900 for k in range(24)], SamplingOptions(max_tokens=1 << 20)))
        while len(sched.running) < a.streams:
            sched.step()
        for _ in range(8):  # steady decode: the decode step measured
            sched.step()
        prompt = image_prompt(0)  # one image every round: its first token must not depend on the way
        sched.add(TextRequest(f"img{r}", list(prompt.ids), SamplingOptions(max_tokens=2), media=prompt.media))
        pieces_before = sched.vision_pieces
        tic, gaps, first, token = time.perf_counter(), [], None, None
        while first is None:
            t = time.perf_counter()
            outs = sched.step()
            gaps.append(time.perf_counter() - t)
            mine = [o for o in outs if o.request_id == f"img{r}" and o.new_token_ids]
            if mine:
                first, token = time.perf_counter() - tic, mine[0].new_token_ids[0]
        for rid in [f"t{r}-{i}" for i in range(a.streams)] + [f"img{r}"]:
            sched.abort(rid)
        while sched.has_work():
            sched.step()
        return {"pieces": pieces, "max_gap_s": max(gaps), "steps": len(gaps), "image_ttft_s": first,
                "decode_step_s": sched.decode_step_s, "vision_pieces": sched.vision_pieces - pieces_before,
                "image_first_token": token}

    start, end = image_prompt(0).media.spans[0]
    image_tokens = end - start
    one_round(-1, True)  # warm-up: every shape compiled once
    one_round(-2, False)
    progress("warmed up")
    rounds = []
    for r in range(a.rounds):
        rounds.append(one_round(r, r % 2 == 0))
        progress(f"round {r}: " + json.dumps({k: rounds[-1][k] for k in ("pieces", "max_gap_s", "image_ttft_s")}))

    def med(key: str, pieces: bool) -> float:
        return statistics.median(x[key] for x in rounds if x["pieces"] is pieces)

    report = {"commit": commit(), "device": device_line(), "model": str(path), "vision_blocks": blocks,
              "streams": a.streams, "image_size": a.image_size, "image_tokens": image_tokens, "rounds": rounds,
              "summary": {way: {k: med(k, way == "pieces") for k in ("max_gap_s", "image_ttft_s", "decode_step_s")}
                          for way in ("pieces", "whole")},
              # greedy, the same image: the features in pieces are one call's, so its first token is too
              "tokens_equal": len({x["image_first_token"] for x in rounds}) == 1}
    s = report["summary"]
    print(f"vision tower of {blocks} blocks, an image of {image_tokens} tokens, {a.streams} streams decoding, "
          f"medians of {a.rounds // 2} rounds each:")
    for way in ("pieces", "whole"):
        print(f"  {way:<7} worst gap {s[way]['max_gap_s'] * 1e3:7.1f} ms (decode step {s[way]['decode_step_s'] * 1e3:.1f} ms), "
              f"image first token {s[way]['image_ttft_s'] * 1e3:7.1f} ms")
    print(f"  the image's first token the same both ways: {report['tokens_equal']}")
    if a.out is not None:
        a.out.write_text(json.dumps(report, indent=2))
    mx.clear_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
