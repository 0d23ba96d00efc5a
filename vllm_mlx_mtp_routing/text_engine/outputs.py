"""What the text engine reports for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass

from .logprobs import TokenLogprob


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
