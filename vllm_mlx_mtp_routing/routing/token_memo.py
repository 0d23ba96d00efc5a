"""A later turn's prompt tokenized from where it stops repeating an earlier one.

A conversation's next request repeats the previous prompt's text up to the last turn (the system prompt, the tools,
every earlier message): tokenizing it whole again is most of a later turn's prompt preparation (a 4.7K-token prompt:
~15 ms, against ~0.2 ms for its new ~60 tokens). Where the tokenizer provably tokenizes the text between its added
tokens piece by piece (``shared_tokens.splits_at_added_tokens``, the argument ``SharedTokens`` rests on), the tokens
up to the last added token the two texts share are the earlier prompt's own, and only the rest is tokenized. Any
other tokenizer tokenizes the whole text. Each prompt preparer keeps its own memo (one worker thread uses it). A
request's ``cache_salt`` keys it as it keys the prefix cache: prompts of another salt are never reused (not even the
milliseconds it saves may tell one user what another sent).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..prefix_cache.shared_tokens import common_prefix_len, splits_at_added_tokens

KEEP = 16  # recent prompts: a few concurrent conversations' last turns


@dataclass(frozen=True)
class Tokenized:
    """A prompt's tokens and, for each added token in it, where its text ends and the index of the token after it."""

    text: str
    space: str | None  # the request's cache salt
    ids: list[int]
    added_ends: list[int]
    added_next: list[int]


class TokenMemo:
    def __init__(self, tokenizer: Any, keep: int = KEEP) -> None:
        self.tokenizer = tokenizer
        self.enabled = splits_at_added_tokens(tokenizer)
        self._added = set(tokenizer.added_tokens_decoder) if self.enabled else set()
        self._recent: deque[Tokenized] = deque(maxlen=keep)
        self.reused_tokens = 0

    def tokenize(self, text: str, space: str | None = None) -> Tokenized:
        """``text``'s tokens (``add_special_tokens=False``), equal to tokenizing it whole; ``space``: the request's
        cache salt (only prompts of the same one are reused)."""
        cut = start = k = 0
        base: Tokenized | None = None
        if self.enabled:
            for seen in self._recent:
                if seen.space != space:
                    continue
                if seen.text == text:  # a request sent again
                    return seen
                agree = common_prefix_len(text, seen.text)
                j = bisect_right(seen.added_ends, agree) - 1
                if j >= 0 and seen.added_ends[j] > cut:
                    base, cut, start, k = seen, seen.added_ends[j], seen.added_next[j], j + 1
        encoding = self.tokenizer(text[cut:], add_special_tokens=False)
        tail = list(encoding["input_ids"])
        ends, nexts = (list(base.added_ends[:k]), list(base.added_next[:k])) if base is not None else ([], [])
        if self.enabled:
            for i, t in enumerate(tail):
                if t in self._added:
                    ends.append(cut + encoding.token_to_chars(i).end)
                    nexts.append(start + i + 1)
        ids = (base.ids[:start] if base is not None else []) + tail
        out = Tokenized(text, space, ids, ends, nexts)
        self.reused_tokens += start
        if self.enabled:
            self._recent.appendleft(out)
        return out
