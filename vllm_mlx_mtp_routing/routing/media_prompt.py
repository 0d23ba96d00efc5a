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
from . import image_memo
from .image_memo import ImageMemo, ProcessedImage
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
    image_token_id: int, merge: int, positions: bool = False, images: ImageMemo | None = None,
) -> MediaPrompt:
    """The prompt and images of a chat with image parts and, with ``positions``, where it is worth a prefix-cache
    snapshot; RequestRejected (400) for an image that cannot be read. ``images``: images processed before (the
    caller's thread's own), which a request that resends all of its images takes instead of the processor's work."""
    references, _, _ = host.media_references(messages)
    prompt = render(messages, len(references))
    keys = [image_memo.key_of(ref) for ref in references] if images is not None else []
    placeholder_ids: list[int] | None = None
    found: Marks = []
    if positions or images is not None:
        tokenizer = getattr(processor, "tokenizer", processor)
        placeholder_ids, found = prepare_chat(
            tokenizer, lambda m: render(m, len(host.media_references(m)[0])), messages, positions=positions
        )
    known = images.get(keys) if images is not None else None
    if known is not None and placeholder_ids is not None:
        grid = [image.grid for image in known]
        counts = [t * h * w // (merge * merge) for t, h, w in grid]
        ids = image_memo.expand_placeholders(placeholder_ids, image_token_id, counts)
        if ids is not None:
            pixel_values = mx.array(np.concatenate([image.pixels for image in known]))
            media = MediaInput(pixel_values, grid, image_spans(ids, image_token_id, counts), [image.digest for image in known])
            return MediaPrompt(ids, media, expanded_marks(found, placeholder_ids, image_token_id, counts))
    files = []
    for n, ref in enumerate(references):
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
    counts = [t * h * w // (merge * merge) for t, h, w in grid]
    spans = image_spans(ids, image_token_id, counts)
    digests, rows, row = [], [], 0
    flat = np.asarray(pixel_values)
    for t, h, w in grid:
        rows.append(np.ascontiguousarray(flat[row : row + t * h * w]))
        digests.append(hashlib.sha256(rows[-1].tobytes()).digest())
        row += t * h * w
    if images is not None and placeholder_ids is not None:
        images.check(ids, image_memo.expand_placeholders(placeholder_ids, image_token_id, counts))
        for key, pixels_of, g, digest in zip(keys, rows, grid, digests):
            images.put(key, ProcessedImage(pixels_of.copy(), g, digest))
    marks = expanded_marks(found, placeholder_ids, image_token_id, counts) if positions and placeholder_ids is not None else []
    return MediaPrompt(ids, MediaInput(pixel_values, grid, spans, digests), marks)
