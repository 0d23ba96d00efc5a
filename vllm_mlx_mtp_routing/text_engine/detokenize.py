"""Streaming detokenization with stop strings.

Text is only released once it can no longer turn out to be (the start of) a stop string, so a
stop string is never emitted even when it spans several tokens, and partial UTF-8 never leaves
(the mlx-lm streaming detokenizers hold back incomplete characters; an incomplete one at the end
of generation is dropped, see ``StopText.finish``).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper


def make_detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer for an mlx-lm TokenizerWrapper or a Hugging Face tokenizer."""
    if isinstance(tokenizer, TokenizerWrapper):
        return tokenizer.detokenizer
    # Same choice as the host's schedulers: correct for any tokenizer.
    return NaiveStreamingDetokenizer(tokenizer)


def eos_ids_of(tokenizer: Any) -> set[int]:
    if isinstance(tokenizer, TokenizerWrapper):
        return set(tokenizer.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple, set)) else {int(eos)}


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopText:
    """Detokenizes one request's tokens and finds its stop strings."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self._detok = make_detokenizer(tokenizer)
        self._detok.reset()
        self._stops = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._scanned = 0  # text before this index has been searched for stop strings
        self._emitted = 0
        self.text = ""
        self.stopped = False

    def add(self, token: int) -> bool:
        """Add a generated token; True when a stop string has appeared."""
        self._detok.add_token(token)
        return self._update(self._detok.text)

    def finish(self) -> None:
        """Flush the detokenizer at the end of generation (not needed after a stop string).

        The detokenizers decode what they held back with errors="replace": the bytes of a character
        that max_tokens cut in two would end the text as U+FFFD. They are dropped (the character was
        never whole); a U+FFFD already released mid-text (an invalid sequence) stays."""
        if not self.stopped:
            held = self._detok.text
            self._detok.finalize()
            full = self._detok.text
            if full.startswith(held):
                full = held + full[len(held) :].rstrip("\ufffd")
            self._update(full)

    def take_new(self, final: bool) -> str:
        """Text not yet released; at a non-final step, hold back a possible stop-string start."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= _held_back(self.text, self._stops)
        new = self.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return new

    def _update(self, full: str) -> bool:
        if self.stopped:
            return True
        if self._stops:
            start = max(0, self._scanned - self._max_stop + 1)
            hits = [i for i in (full.find(s, start) for s in self._stops) if i >= 0]
            self._scanned = len(full)
            if hits:
                self.text = full[: min(hits)]
                self.stopped = True
                return True
        self.text = full
        return False
