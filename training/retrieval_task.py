"""A synthetic key-value retrieval task mixed into code, for training and judging long-context models.

A definition line ``\\n# set K V1 V2\\n`` and, later, a query ``\\n# get K`` whose answer is ``V1 V2``
(then ``\\n``). Keys and values are single-word tokens of the tokenizer (`` foo``), one token a key and two a
value, keys distinct within a window; key and value pools are disjoint. The value follows the key directly, so
an attention layer that matches the key can copy it (an induction pattern), however far back the definition is.

Training windows carry many pairs at random places (``training_window``); the loss mask marks the
answers' tokens. Judging prompts (``retrieval_prompt``) hold one queried definition at a chosen distance
before the question plus distractor definitions, and end right after the queried key: the model's next
tokens should be the value. Chance of the exact value is 1 / len(values)^2.

A quarter of the word tokens is held out (a fixed shuffle; ``load_task(..., split=)``): judging uses keys and
values the model never saw in a definition, so a right answer is retrieval, not a memorised pair.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Task:
    def_prefix: tuple[int, ...]
    query_prefix: tuple[int, ...]
    newline: tuple[int, ...]
    keys: np.ndarray  # token ids a key is drawn from
    values: np.ndarray  # token ids a value is drawn from

    @property
    def def_len(self) -> int:
        return len(self.def_prefix) + 3 + len(self.newline)

    @property
    def query_len(self) -> int:  # with its answer and newline
        return len(self.query_prefix) + 3 + len(self.newline)

    def definition(self, key: tuple[int], value: tuple[int, int]) -> list[int]:
        return [*self.def_prefix, *key, *value, *self.newline]

    def query(self, key: tuple[int]) -> list[int]:
        return [*self.query_prefix, *key]


SPLITS = ("train", "heldout")


def load_task(tokenizer_json: Path, split: str = "train", value_pool: int = 0) -> Task:
    """The task's token ids for this tokenizer (byte-level BPE: a word token decodes to `` word``): held out, a
    quarter of the single-word tokens (half keys, half values); for training, keys from the other three quarters and
    values from every other identifier-like token (``value_pool`` > 0: that many of them, a fixed draw)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))

    def enc(s: str) -> tuple[int, ...]:
        return tuple(tok.encode(s, add_special_tokens=False).ids)

    words = [i for i in range(tok.get_vocab_size()) if re.fullmatch(r" [a-z]{3,10}", tok.decode([i]) or "")]
    if len(words) < 64:
        raise SystemExit(f"the tokenizer has only {len(words)} single-word tokens; the task needs 64")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    ids = np.random.default_rng(38).permutation(np.asarray(words, dtype=np.int64))
    held = ids[: len(ids) // 4]
    if split == "heldout":
        return Task(enc("\n# set"), enc("\n# get"), enc("\n"), keys=held[0::2], values=held[1::2])
    keys = ids[len(ids) // 4 :][0::2]
    # Training values: every identifier-like token but the held-out words and the keys, so what is learnt is to
    # copy, not a small pool of likely answers (which would rank the held-out values below it).
    names = [i for i in range(tok.get_vocab_size()) if re.fullmatch(r" ?[A-Za-z_][A-Za-z0-9_]+", tok.decode([i]) or "")]
    values = np.setdiff1d(np.asarray(names, dtype=np.int64), np.concatenate([held, keys]))
    if value_pool > 0:
        values = np.sort(np.random.default_rng(39).permutation(values)[:value_pool])
    return Task(enc("\n# set"), enc("\n# get"), enc("\n"), keys=keys, values=values)


def _pairs(task: Task, rng: np.random.Generator, n: int) -> list[tuple[tuple[int], tuple[int, int]]]:
    keys = rng.choice(task.keys, size=n, replace=False)  # distinct: no two keys alike in a window
    vals = rng.choice(task.values, size=(n, 2))
    return [((int(k),), (int(v[0]), int(v[1]))) for k, v in zip(keys, vals)]


def training_window(task: Task, corpus: np.ndarray, rng: np.random.Generator, length: int, n_pairs: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``length`` tokens: corpus text with ``n_pairs`` definitions and their queries (each query after its
    definition) at random places -> (tokens, mask): mask[t] = 1 where tokens[t] is an answer token."""
    text_len = length - n_pairs * (task.def_len + task.query_len)
    if text_len < 1:
        raise ValueError("the window is too short for that many pairs")
    start = int(rng.integers(0, corpus.size - text_len))
    text = corpus[start : start + text_len]
    points = np.sort(rng.integers(0, text_len + 1, size=2 * n_pairs))
    perm = rng.permutation(2 * n_pairs)
    slot: dict[int, tuple[str, int]] = {}
    for i in range(n_pairs):
        a, b = sorted((int(perm[2 * i]), int(perm[2 * i + 1])))
        slot[a], slot[b] = ("def", i), ("query", i)
    pairs = _pairs(task, rng, n_pairs)
    out: list[int] = []
    mask: list[int] = []
    at = 0
    for j in range(2 * n_pairs):
        p = int(points[j])
        out += text[at:p].tolist()
        mask += [0] * (p - at)
        at = p
        kind, i = slot[j]
        key, value = pairs[i]
        if kind == "def":
            seg = task.definition(key, value)
            out += seg
            mask += [0] * len(seg)
        else:
            q = task.query(key)
            out += q + [*value, *task.newline]
            mask += [0] * len(q) + [1, 1] + [0] * len(task.newline)
    out += text[at:].tolist()
    mask += [0] * (text_len - at)
    return np.asarray(out, dtype=np.int32), np.asarray(mask, dtype=np.float32)


@dataclass
class Prompt:
    ids: list[int]
    answer: list[int]  # the value's two tokens
    def_span: tuple[int, int]  # prompt positions of the queried definition's key and value
    distance: int  # tokens from the queried definition to the prompt's end


def retrieval_prompt(task: Task, corpus: np.ndarray, rng: np.random.Generator, length: int, distance: int,
                     distractors: int) -> Prompt:
    """A ``length``-token prompt of corpus text ending with a query; its definition starts about ``distance``
    tokens before the end, ``distractors`` other definitions anywhere before the query."""
    n = 1 + distractors
    q_len = len(task.query_prefix) + 1
    text_len = length - n * task.def_len - q_len
    start = int(rng.integers(0, corpus.size - text_len))
    text = corpus[start : start + text_len].tolist()
    pairs = _pairs(task, rng, n)
    where = [max(0, min(text_len, text_len - distance))] + [int(x) for x in rng.integers(0, text_len + 1, size=distractors)]
    order = sorted(range(n), key=lambda i: (where[i], i))
    ids: list[int] = []
    at = 0
    span = (0, 0)
    for i in order:
        ids += text[at : where[i]]
        at = where[i]
        seg = task.definition(*pairs[i])
        if i == 0:
            k0 = len(ids) + len(task.def_prefix)
            span = (k0, k0 + 3)
        ids += seg
    ids += text[at:]
    ids += task.query(pairs[0][0])
    return Prompt(ids, list(pairs[0][1]), span, len(ids) - span[0])
