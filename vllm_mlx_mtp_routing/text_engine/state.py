"""The engine's currency: a request, its prefill-stage caches and what it reports.

Shared by the scheduler, the runner, the prefix cache, SpecPrefill and n-sharing; it imports none of them, so
each of them can import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from ..model.layered_forward import LayerProgress
from ..model.media_forward import VisionProgress
from ..model.mlx_lm_internals import KVCache
from .logprobs import TokenLogprob
from .sampling import SamplingOptions


class SharingRow(Protocol):
    """What n-sharing reads and sets of a row (``row.Row``)."""

    req: TextRequest
    prefill: PrefillState | None
    shared_prefill: bool

    @property
    def to_prefill(self) -> int: ...


class PrefixPlan(Protocol):
    """A row's prefix-cache plan as the scheduler uses it (``prefix_cache.plan.SnapshotPlan``)."""

    def cut(self, start: int, end: int) -> int: ...

    def after_chunk(self, row: Any, n: int) -> Callable[[], None] | None: ...

    def after_abort(self, row: Any) -> None: ...

    def snapshots_of(self, kind: str) -> list[int]: ...


class SparseJobView(Protocol):
    """A row's SpecPrefill job as the scheduler plans it (``specprefill.pipeline.SparseJob``)."""

    def ready(self) -> bool: ...

    def next_cost(self) -> int: ...

    def advance(self, overlap: bool = False) -> int: ...


class PrefillSharing(Protocol):
    """The n rows of one request prefilled once (``shared_prefill.SharedPrefill``), as the scheduler sees it."""

    def ready(self, row: SharingRow, model: Any, with_head: bool) -> bool: ...

    def joined(self, row: SharingRow, state: PrefillState) -> None: ...

    def left(self, row: SharingRow) -> None: ...


def check_fractions(keep_pct: float, backbone_pct: float) -> None:
    """ValueError unless 0 < keep_pct <= 1 and 0 <= backbone_pct <= keep_pct."""
    if not (isinstance(keep_pct, (int, float)) and math.isfinite(keep_pct) and 0.0 < keep_pct <= 1.0):
        raise ValueError(f"specprefill_keep_pct must be in (0, 1], got {keep_pct!r}")
    if not (isinstance(backbone_pct, (int, float)) and math.isfinite(backbone_pct) and 0.0 <= backbone_pct <= keep_pct):
        raise ValueError(f"specprefill_backbone_pct must be in [0, specprefill_keep_pct={keep_pct}], got {backbone_pct!r}")


@dataclass(frozen=True)
class RequestChoice:
    """A request's own SpecPrefill fields (None: the server's setting)."""

    enabled: bool | None = None
    keep_pct: float | None = None
    backbone_pct: float | None = None

    @classmethod
    def from_options(cls, options: dict) -> RequestChoice:
        """From the host's request options; ValueError (a 400) for values out of range."""
        enabled = options.get("specprefill")
        keep = options.get("specprefill_keep_pct")
        backbone = options.get("specprefill_backbone_pct")
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"specprefill must be a boolean, got {enabled!r}")
        choice = cls(enabled, None if keep is None else float(keep), None if backbone is None else float(backbone))
        if keep is not None or backbone is not None:
            check_fractions(choice.keep_pct if choice.keep_pct is not None else 1.0, choice.backbone_pct or 0.0)
        return choice


@dataclass
class MediaInput:
    """The images of a media request, as the VLM's processor made them; the row prefills them through the vision
    tower and the M-RoPE forward (runner.py, model/media_forward.py).

    ``spans``: each image's tokens in the prompt, [start, end); ``digests``: a hash of each image's decoded pixels, so
    the prefix cache keys a prompt by its tokens and its images (``key_ids``). ``features``, ``position_ids`` and
    ``rope_delta`` are made on the engine's thread when the row needs them.
    """

    pixel_values: mx.array  # every image's patches, image after image
    grid_thw: list[tuple[int, int, int]]
    spans: list[tuple[int, int]]
    digests: list[bytes]
    features: dict[int, mx.array] = field(default_factory=dict)  # image index -> its tokens' embeddings
    # image index -> its vision tower under way in pieces of blocks (media_forward.VisionProgress), and the seconds
    # a block of it took (the next piece's size)
    encoding: dict[int, VisionProgress] = field(default_factory=dict)
    block_s: dict[int, float] = field(default_factory=dict)
    position_ids: mx.array | None = None  # [3, 1, len(prompt)]
    rope_delta: int = 0  # decode positions past the prompt run this far from the token count

    def __post_init__(self) -> None:
        if not (len(self.grid_thw) == len(self.spans) == len(self.digests)):
            raise ValueError("one grid, span and digest per image")

    def patch_rows(self, image: int) -> tuple[int, int]:
        """The pixel rows of one image: [start, end)."""
        start = sum(t * h * w for t, h, w in self.grid_thw[:image])
        t, h, w = self.grid_thw[image]
        return start, start + t * h * w

    def key_ids(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's prefix-cache key: its tokens, each image's tokens replaced by an id made from its digest (negative:
        never a real token), so the same image hits and a different one of the same size does not."""
        ids = list(prompt_ids)
        for (start, end), digest in zip(self.spans, self.digests):
            ids[start:end] = [-1 - int.from_bytes(digest[:7], "big")] * (end - start)
        return ids

    def unencoded(self, start: int, end: int) -> int | None:
        """The first image with tokens in [start, end) whose features are not made yet."""
        for j, (s, e) in enumerate(self.spans):
            if s < end and e > start and j not in self.features:
                return j
        return None


@dataclass
class TextRequest:
    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions = field(default_factory=SamplingOptions)
    # Prompt positions worth a prefix-cache snapshot, with their kind ("system", "message"); the
    # end of the prompt is always one. Used only with a prefix cache.
    snapshot_at: list[tuple[int, str]] = field(default_factory=list)
    # Called once when the request's prefill is done and it joins the decode batch.
    on_joined: Callable[[], None] | None = None
    # One of the n rows of a request (OpenAI ``n``): the rows prefill once (shared_prefill.py).
    share: PrefillSharing | None = None
    # The request's own SpecPrefill fields (None: the server's).
    specprefill: RequestChoice | None = None
    # The client's ``cache_salt``: the prefix-cache snapshots this request reads and makes are keyed by it, so
    # requests with another salt (or none) never share them. None: the unsalted entries.
    cache_salt: str | None = None
    # A media request's images (None: text only).
    media: MediaInput | None = None

    @property
    def cache_ids(self) -> list[int]:
        """What the prefix cache keys this prompt by: its tokens, and its images where it has some."""
        return self.prompt_ids if self.media is None else self.media.key_ids(self.prompt_ids)


@dataclass
class PrefillState:
    """A request's caches before it joins the batch: single-sequence (batch 1) mlx-lm caches.

    - ``backbone``: the layout of ``model.make_cache()`` (``KVCache`` for attention layers,
      ``ArraysCache`` [conv, recurrent] for gated-delta layers) holding ``prompt[:prefilled]``.
    - ``head``: the MTP head's caches (``MTPHead.make_cache()``: one ``KVCache`` per head layer)
      holding the pairs (hidden_t, token_t+1) for t < prefilled - 1, i.e. prefilled - 1 entries.
      None: the head starts empty at that position (it skips the missing positions; drafts are
      still verified, so only acceptance can suffer). A head that started past 0 (its window of
      the prompt, or after a restore without it) holds ``PositionedKVCache``s from there.
    - ``head_hidden``: [1, 1, H], the backbone's hidden state at position prefilled - 1 (what the
      MTP head reads: post-norm unless the config says pre_norm); its pair waits for the next
      token. None: that pair is skipped too.
    - ``prefilled``: prompt tokens already in ``backbone``; at most len(prompt) - 1, since the
      last prompt token is fed by the row's first decode step.
    - ``position``: the RoPE position of the next token when it differs from the keys held (a
      sparse prefill keeps fewer keys than the positions it covered; ``prefilled`` then counts the
      prompt tokens covered and must be len(prompt) - 1); None: the keys held, ``prefilled``.
    """

    backbone: list[Any] | None = None
    head: list[Any] | None = None
    head_hidden: mx.array | None = None
    prefilled: int = 0
    position: int | None = None
    prefill_to: int | None = None  # len(prompt) - 1, set by the scheduler: where the prefill ends
    # A media prompt's M-RoPE delta: its decode positions run this far from the token count (set as the row joins).
    rope_delta: int = 0
    # A chunk whose forward stopped between layers (a step's stall bound): its layers before ``next_layer`` have
    # written their caches, the others not; ``prefilled`` still ends before it, and no snapshot may be taken.
    partial: LayerProgress | None = None

    @property
    def next_position(self) -> int:
        return self.prefilled if self.position is None else self.position

    def check(self, prompt_len: int) -> None:
        """Raise ValueError unless this state can start a request with a prompt of this length."""
        if not 0 <= self.prefilled <= prompt_len - 1:
            raise ValueError(f"prefilled={self.prefilled} must be in [0, {prompt_len - 1}] (the last prompt token is decoded)")
        if self.prefilled and self.backbone is None:
            raise ValueError("prefilled > 0 needs the backbone caches")
        if self.backbone is not None:
            kv = next((c for c in self.backbone if isinstance(c, KVCache)), None)
            held = 0 if kv is None or kv.keys is None else kv.offset
            if self.position is None and held != self.prefilled:
                raise ValueError(f"backbone caches hold {held} tokens, prefilled says {self.prefilled}")
            if self.position is not None and held > self.prefilled:
                raise ValueError(f"backbone caches hold {held} tokens, more than the {self.prefilled} covered")
        if self.position is not None:
            if self.position < self.prefilled:
                raise ValueError("position must be >= prefilled")
            # mlx-lm's single-sequence caches rotate by the keys they hold, not by ``position``: a
            # sparse state cannot be prefilled further, so it must cover all but the last token.
            if self.prefilled != prompt_len - 1:
                raise ValueError("a sparse state (position set) must cover the prompt but its last token")


@dataclass
class TextOutput:
    """One update of one request.

    ``new_text``/``new_token_ids`` are what this step added; ``text``/``token_ids`` are cumulative.
    ``token_ids`` holds every generated token, a final stop token included (it counts in
    ``completion_tokens``), while ``text`` never contains a stop token or stop string.
    ``finish_reason`` is "stop", "length", "abort", or "error" (then ``error`` says why) once
    ``finished``.
    """

    request_id: str
    new_text: str
    text: str
    new_token_ids: list[int]
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finished: bool
    finish_reason: str | None
    mtp_drafted: int = 0
    mtp_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    error: str | None = None
    # With ``logprobs`` requested: one entry per ``new_token_ids`` token, from the model's own logits
    # (before penalties, processors and temperature); None otherwise.
    logprobs: list[TokenLogprob] | None = None
    # SpecPrefill's decision for this request (requested, engaged, reason, original_tokens, selected_tokens);
    # None where the server runs without it.
    specprefill: dict | None = None
