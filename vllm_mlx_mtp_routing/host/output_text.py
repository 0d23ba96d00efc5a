"""The mlx-vlm path's non-streamed text, as the text path would give it.

vllm-mlx 0.6.0 (``mllm_scheduler``) finalizes a request's streaming detokenizer into its non-streamed
text, which decodes held-back bytes with errors="replace": a generation cut by max_tokens inside a
multibyte character ends with U+FFFD (its stream never sends that tail). Those bytes never made a
character: they are dropped, as on the text path (``text_engine.detokenize.StopText.finish``).
"""

from __future__ import annotations

import dataclasses
from typing import Any


def without_cut_character(out: Any) -> Any:
    text = getattr(out, "text", None)
    if getattr(out, "finish_reason", None) != "length" or not isinstance(text, str) or not text.endswith("\ufffd"):
        return out
    return dataclasses.replace(out, text=text.rstrip("\ufffd"))
