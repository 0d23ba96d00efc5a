"""Images already processed, by the digest of their data: URL: a later turn that resends one skips its decode, the
VLM's processor and the pixel hash.

An agent resends the same screenshot with every turn of a conversation. Its pixels, patch grid and pixel digest are
a function of the image's bytes and the processor alone; the prompt's tokens are the chat template's text with each
image placeholder expanded to the image's token count, which a media prompt gets by tokenizing the text with one
placeholder per image and expanding those (``expand_placeholders``). Each time the processor does run, its tokens are
compared with that expansion; one disagreement (another processor's scheme) turns the memo's hits off for good.
Only data: URLs are kept (an http(s) URL's content may change); memory is bounded (least recently used first out).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger("vllm_mlx_mtp_routing.routing")

BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # this image's rows of the processor's pixel_values
    grid: tuple[int, int, int]
    digest: bytes  # of the decoded pixels (the prefix cache's key for the image)


def key_of(reference: Any) -> str | None:
    """The memo's key of an image reference: a data: URL's digest; None for anything else."""
    url = reference if isinstance(reference, str) else None
    if url is None or not url.startswith("data:"):
        return None
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()


def expand_placeholders(ids: list[int], image_token_id: int, tokens_per_image: list[int]) -> list[int] | None:
    """``ids`` with the n-th image placeholder token repeated as many times as the n-th image has tokens; None when
    the placeholders are not one per image."""
    if ids.count(image_token_id) != len(tokens_per_image):
        return None
    out: list[int] = []
    counts = iter(tokens_per_image)
    for t in ids:
        out.extend([t] * next(counts) if t == image_token_id else [t])
    return out


class ImageMemo:
    def __init__(self, budget_bytes: int = BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._images: OrderedDict[str, ProcessedImage] = OrderedDict()
        self.nbytes = 0
        self.trusted = True  # the processor's tokens have always equalled the expansion
        self.hits = 0

    def get(self, keys: list[str | None]) -> list[ProcessedImage] | None:
        """Every image of a request, or None unless the memo has them all (and its expansion holds)."""
        if not self.trusted or not keys or any(k is None or k not in self._images for k in keys):
            return None
        out = []
        for k in keys:
            assert k is not None  # checked above
            self._images.move_to_end(k)
            out.append(self._images[k])
        self.hits += 1
        return out

    def check(self, processor_ids: list[int], expanded: list[int] | None) -> None:
        """The processor's tokens for a prompt against the expansion of its placeholders: a disagreement ends hits."""
        if self.trusted and expanded != processor_ids:
            self.trusted = False
            self._images.clear()
            self.nbytes = 0
            logger.info("image memo off: this processor's prompt tokens are not the placeholders expanded")

    def put(self, key: str | None, image: ProcessedImage) -> None:
        if key is None or not self.trusted or key in self._images or image.pixels.nbytes > self.budget_bytes:
            return
        self._images[key] = image
        self.nbytes += image.pixels.nbytes
        while self.nbytes > self.budget_bytes:
            _, old = self._images.popitem(last=False)
            self.nbytes -= old.pixels.nbytes
