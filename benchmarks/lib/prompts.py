"""A long prompt of a given token count for the target's tokenizer: word salad with numbered lines, no repeats a
prefix cache could find."""

from __future__ import annotations

from pathlib import Path


def long_prompt(model: Path, tokens: int, room: int = 16) -> str:
    """About ``tokens`` tokens of text, ``room`` of them left for the chat template's own tokens (and a caller's tag)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
             "upsilon phi chi psi omega def class return import while for if else yield").split()
    text, ids, i = "", [], 0
    while len(ids) < tokens:
        text += " ".join(words[(i * 7 + j) % len(words)] for j in range(200)) + f" {i}\n"
        ids = tok.encode(text, add_special_tokens=False)
        i += 1
    return tok.decode(ids[: tokens - room])
