"""The text engine with the vision tower, built in process as the server builds it, for the benchmarks that drive one
(its prefill budget calibrated at start, ``--prefill-stall-ratio``'s default) and the prompts of image requests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_mlx_mtp_routing.model.media_forward import VisionParts
from vllm_mlx_mtp_routing.model.text_model import build_text_model
from vllm_mlx_mtp_routing.routing.media_prompt import MediaPrompt, prepare_media_chat
from vllm_mlx_mtp_routing.text_engine.prefill_budget import DEFAULT_RATIO, calibrate
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler


@dataclass
class MediaEngine:
    processor: Any
    vision: VisionParts
    sched: BatchScheduler

    def render(self, msgs: list[dict], images: int) -> str:
        from vllm_mlx.engine.batched import BatchedEngine

        return self.processor.apply_chat_template(BatchedEngine._prepare_mllm_messages(msgs), tokenize=False,
                                                  add_generation_prompt=True)

    def media_prompt(self, msgs: list[dict]) -> MediaPrompt:
        return prepare_media_chat(self.processor, self.render, msgs, image_token_id=self.vision.image_token_id,
                                  merge=self.vision.merge, positions=False)


def media_engine(path: Path, max_num_seqs: int, max_pixels: int = 0) -> MediaEngine:
    """``max_pixels``: the processor's pixel cap (0: the model's own)."""
    from mlx_vlm import load

    vlm, processor = load(str(path))
    if max_pixels:
        processor.image_processor.max_pixels = max_pixels
    config = json.loads((path / "config.json").read_text())
    bundle = build_text_model(vlm, path, config, enable_mtp=False)
    vision = VisionParts(vlm, config)
    sched = BatchScheduler(bundle.model, processor.tokenizer, max_num_seqs=max_num_seqs, prefill_step_size=2048,
                           vision=vision)
    calibrate(bundle.model, max_chunk=2048, ratio=DEFAULT_RATIO, vocab_size=bundle.model.args.vocab_size).apply(sched)
    return MediaEngine(processor, vision, sched)
