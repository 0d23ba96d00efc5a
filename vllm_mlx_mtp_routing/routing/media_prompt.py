"""A media request's prompt, prepared off the event loop: the host's chat template with its image placeholders, its
images fetched and decoded, the VLM's processor run over both, each image's tokens located and its pixels hashed.

The result is what the text engine's media rows take (``text_engine.state.MediaInput``): token ids with every image
expanded to its tokens, the processor's pixel patches and grids, and a digest of each image's decoded pixels (the
prefix cache keys a media prompt by its tokens and its images).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from ..host import engine_access as host
from ..plugin_api.errors import RequestRejected
from ..text_engine.state import MediaInput
from .prompt_preparation import Marks, prepare_chat


@dataclass(frozen=True)
class MediaPrompt:
    ids: list[int]
    media: MediaInput
    marks: Marks = field(default_factory=list)  # where the prompt is worth a prefix-cache snapshot


def image_spans(ids: list[int], image_token_id: int, tokens_per_image: list[int]) -> list[tuple[int, int]]:
    """Each image's run of image tokens, in order; ValueError unless the runs are the images' token counts."""
    spans: list[tuple[int, int]] = []
    i = 0
    for count in tokens_per_image:
        while i < len(ids) and ids[i] != image_token_id:
            i += 1
        if ids[i : i + count] != [image_token_id] * count:
            raise ValueError(f"the prompt has no run of {count} image tokens for image {len(spans)}")
        spans.append((i, i + count))
        i += count
    if image_token_id in ids[i:]:
        raise ValueError("the prompt has more image tokens than its images")
    return spans


def expanded_marks(marks: Marks, placeholder_ids: list[int], image_token_id: int, tokens_per_image: list[int]) -> Marks:
    """Snapshot positions found on the prompt with one placeholder token per image, moved to the prompt the processor
    expanded (each placeholder became the image's tokens)."""
    pads = [p for p, t in enumerate(placeholder_ids) if t == image_token_id]
    if len(pads) != len(tokens_per_image):
        return []  # the template placed them otherwise: the end of the prompt stays a snapshot
    out = []
    for pos, kind in marks:
        grown = sum(n - 1 for p, n in zip(pads, tokens_per_image) if p < pos)
        out.append((pos + grown, kind))
    return out


def prepare_media_chat(
    processor: Any, render: Callable[[list[dict[str, Any]], int], str], messages: list[dict[str, Any]], *,
    image_token_id: int, merge: int, positions: bool = False,
) -> MediaPrompt:
    """The prompt and images of a chat with image parts and, with ``positions``, where it is worth a prefix-cache
    snapshot; RequestRejected (400) for an image that cannot be read."""
    images, _, _ = host.media_references(messages)
    prompt = render(messages, len(images))
    files = []
    for n, ref in enumerate(images):
        try:
            files.append(host.load_image(ref))
        except Exception as exc:  # the client's image: its own 400
            raise RequestRejected(400, f"image {n + 1} cannot be read: {exc}") from exc
    try:
        inputs = host.processor_inputs(processor, files, prompt, image_token_id)
    except Exception as exc:  # an image the processor cannot decode
        raise RequestRejected(400, f"images cannot be processed: {type(exc).__name__}: {exc}") from exc
    ids = [int(t) for t in np.asarray(inputs["input_ids"]).reshape(-1)]
    grid = [(int(t), int(h), int(w)) for t, h, w in np.asarray(inputs["image_grid_thw"]).reshape(-1, 3)]
    pixels = inputs["pixel_values"]
    pixel_values = pixels if isinstance(pixels, mx.array) else mx.array(np.asarray(pixels))
    spans = image_spans(ids, image_token_id, [t * h * w // (merge * merge) for t, h, w in grid])
    digests, row = [], 0
    flat = np.asarray(pixel_values)
    for t, h, w in grid:
        digests.append(hashlib.sha256(np.ascontiguousarray(flat[row : row + t * h * w]).tobytes()).digest())
        row += t * h * w
    marks: Marks = []
    if positions:
        tokenizer = getattr(processor, "tokenizer", processor)
        placeholder_ids, found = prepare_chat(
            tokenizer, lambda m: render(m, len(host.media_references(m)[0])), messages, positions=True
        )
        marks = expanded_marks(found, placeholder_ids, image_token_id, [e - s for s, e in spans])
    return MediaPrompt(ids, MediaInput(pixel_values, grid, spans, digests), marks)
