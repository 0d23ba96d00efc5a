"""SpecPrefill's settings (the host's flags) and the per-request decision.

The host's meaning, kept on the text path: ``--specprefill`` with ``--specprefill-draft-model``
turns it on; a prompt whose part still to prefill (after a prefix-cache hit) is longer than
``--specprefill-threshold`` tokens is prefilled sparsely, keeping ``--specprefill-keep-pct`` of it
(``--specprefill-backbone-pct`` of the chunks evenly spaced, the rest by score). Per request,
``specprefill: false`` opts out, ``specprefill: true`` engages below the threshold too, and
``specprefill_keep_pct`` / ``specprefill_backbone_pct`` override the flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..text_engine.state import RequestChoice, check_fractions

__all__ = ["MAX_SCORED_TOKENS", "RequestChoice", "SpecPrefillSettings", "check_fractions", "decide"]

# As the host's SimpleEngine: past this many tokens the draft's attention scores cost too much memory.
MAX_SCORED_TOKENS = 65536


@dataclass(frozen=True)
class SpecPrefillSettings:
    threshold: int = 8192
    keep_pct: float = 0.3
    backbone_pct: float = 0.0
    chunk_tokens: int = 32  # the unit kept or dropped (the paper's and the host's)
    look_ahead: int = 8  # draft tokens whose queries score the prompt (the host's default)
    pool_kernel: int = 13  # smoothing of token scores before chunk means (the paper's)
    max_tokens: int = MAX_SCORED_TOKENS

    def __post_init__(self) -> None:
        check_fractions(self.keep_pct, self.backbone_pct)
        if self.threshold < 0 or self.chunk_tokens < 1 or self.look_ahead < 1 or self.pool_kernel < 1:
            raise ValueError("threshold must be >= 0; chunk_tokens, look_ahead and pool_kernel >= 1")


def decide(settings: SpecPrefillSettings, choice: RequestChoice, suffix_tokens: int) -> tuple[float, float] | None:
    """(keep_pct, backbone_pct) when these ``suffix_tokens`` (the prompt after any prefix-cache hit,
    but its last token) are to be prefilled sparsely, else None."""
    if choice.enabled is False or suffix_tokens < 2:
        return None
    if choice.enabled is not True and suffix_tokens <= settings.threshold:
        return None
    keep = settings.keep_pct if choice.keep_pct is None else choice.keep_pct
    backbone = settings.backbone_pct if choice.backbone_pct is None else choice.backbone_pct
    backbone = min(backbone, keep)
    if keep >= 1.0:
        return None
    return keep, backbone
