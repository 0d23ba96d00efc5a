"""What the routing engine serves with once the host has loaded the model, built by ``assembly`` and handed over
once (``RoutingEngine.attach``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..admission import AdmissionController
from ..model.checkpoint_layouts import MTPUnavailable
from ..model.media_forward import VisionParts
from ..text_engine.engine import TextEngine
from ..text_engine.prefill_budget import PrefillBudget
from ..text_engine.spec.mtp import MTPDecode
from .prompt_preparation import PromptPreparer


@dataclass(frozen=True)
class TextPath:
    """The text path: the engine and what serves it."""

    engine: TextEngine
    prefill_budget: PrefillBudget
    mtp: MTPDecode | MTPUnavailable | None  # MTPUnavailable: MTP asked for, the checkpoint has no usable head
    prompts: PromptPreparer | None  # None: prompts prepared on the event loop
    warm_prefixes: frozenset[str]  # --warm-prompts prefixes: their snapshots are system prefixes
    vocab_size: int
    vision: VisionParts | None = None  # media rows' vision tower and positions; None: media go to the host's path
    media_unavailable: str | None = None  # why media requests go to the host's path

    @property
    def drafts(self) -> bool:
        return isinstance(self.mtp, MTPDecode) and self.mtp.k > 0


@dataclass(frozen=True)
class ServingParts:
    """Both paths' parts; ``text`` is None (and ``text_unavailable`` says why) when the model cannot have one."""

    tokenizer: Any
    context_tokens: int | None  # the model's max_position_embeddings
    tokens_per_media_item: int  # the host processor's bound on one media item's tokens
    admission: AdmissionController | None
    text: TextPath | None
    text_unavailable: str | None = None
    strict_max_tokens: bool = False  # --strict-max-tokens: an explicit max_tokens over the context is a 400, not cut

    def __post_init__(self) -> None:
        if (self.text is None) == (self.text_unavailable is None):
            raise ValueError("a text path, or the reason there is none")
