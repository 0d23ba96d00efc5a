"""How many of a prompt's tokens another text's tokens share, without tokenizing that text whole.

``boundaries.snapshot_positions`` turns a rendered prefix into a token position as
``common(encode(prefix), prompt_ids)``: one more tokenization of (nearly) the whole prompt per
boundary. A Hugging Face fast tokenizer splits its input at added tokens (``<|im_start|>``,
``<|im_end|>``, ...) before it normalizes and pre-tokenizes, and tokenizes the pieces between them
independently; so where ``prefix`` and the prompt agree up to an added token, ``encode(prefix)``
is the prompt's own tokens up to that added token followed by ``encode`` of the rest of ``prefix``.
``SharedTokens`` re-encodes only that rest (in a ChatML template: ``user\\n`` or ``assistant\\n``), with
the same result. The split argument needs added tokens matched on the raw text (not normalized, no
stripping, not single-word) none of which contains another; other tokenizers take the full encode.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """``len(os.path.commonprefix([a, b]))`` for strings or lists, by halving slices (compared in C)
    instead of a Python step per character, so a long prompt's text costs a few C comparisons."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def splits_at_added_tokens(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` provably tokenizes the text between its added tokens piece by piece."""
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "split_special_tokens", False):
        return False
    try:
        added = list(tokenizer.added_tokens_decoder.values())
    except Exception:
        return False
    contents = [str(t.content) for t in added]
    if any(t.normalized or t.lstrip or t.rstrip or t.single_word for t in added) or not all(contents):
        return False
    # One added token inside another could match across the cut in a text that goes on differently.
    return not any(a != b and a in b for a in contents for b in contents)


class SharedTokens:
    """``shared(text) == common_prefix_len(encode(text), ids)`` for the prompt ``text`` was rendered
    beside; ``encoding`` is the tokenizer's ``BatchEncoding`` of ``prompt`` (its ``token_to_chars``)."""

    def __init__(self, tokenizer: Any, prompt: str, ids: Sequence[int], encoding: Any, encode: Callable[[str], list[int]]) -> None:
        self.prompt, self.ids, self.encode = prompt, ids, encode
        self._ends: list[int] = []  # char end of each added token of the prompt, in order
        self._next: list[int] = []  # the index of the token after it
        if splits_at_added_tokens(tokenizer):
            added = set(tokenizer.added_tokens_decoder)
            for i, t in enumerate(ids):
                if t in added:
                    self._ends.append(encoding.token_to_chars(i).end)
                    self._next.append(i + 1)

    @classmethod
    def of_added(cls, prompt: str, ids: Sequence[int], added_ends: list[int], added_next: list[int],
                 encode: Callable[[str], list[int]]) -> SharedTokens:
        """From the prompt's added tokens already found (the char end of each and the index of the token after it;
        empty for a tokenizer that ``splits_at_added_tokens`` does not accept)."""
        out = cls.__new__(cls)
        out.prompt, out.ids, out.encode = prompt, ids, encode
        out._ends, out._next = added_ends, added_next
        return out

    def __call__(self, text: str) -> int:
        agree = common_prefix_len(text, self.prompt)
        k = bisect_right(self._ends, agree) - 1
        cut, start = (self._ends[k], self._next[k]) if k >= 0 else (0, 0)
        tail = self.encode(text[cut:])
        return start + common_prefix_len(tail, self.ids[start : start + len(tail)])
