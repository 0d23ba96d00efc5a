"""The synthetic retrieval task that trains and judges the long-context SpecPrefill pair (training/retrieval_task.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

from retrieval_task import load_task, retrieval_prompt, training_window  # noqa: E402


@pytest.fixture(scope="module")
def task():
    return load_task(REPO / "models" / "tiny-qwen35-trained" / "tokenizer.json")


def corpus(n: int = 20_000) -> np.ndarray:
    return np.random.default_rng(0).integers(300, 3000, size=n).astype(np.int32)


def test_training_window_masks_exactly_the_answers_of_earlier_definitions(task):
    x, mask = training_window(task, corpus(), np.random.default_rng(1), 1024, 6)
    assert x.shape == mask.shape == (1024,)
    answers = np.flatnonzero(mask)
    assert len(answers) == 12
    qp = list(task.query_prefix)
    dp = list(task.def_prefix)
    for t in answers[::2]:
        key = x[t - 1 : t].tolist()
        assert x[t - 1 - len(qp) : t - 1].tolist() == qp
        # the definition K V1 V2 occurs earlier in the window
        defs = [s for s in range(t) if x[s : s + len(dp)].tolist() == dp and x[s + len(dp) : s + len(dp) + 1].tolist() == key]
        assert len(defs) == 1
        s = defs[0] + len(dp)
        assert x[s + 1 : s + 3].tolist() == x[t : t + 2].tolist()


def test_retrieval_prompt_ends_on_the_key_with_its_definition_at_the_distance(task):
    p = retrieval_prompt(task, corpus(), np.random.default_rng(2), 4096, 2500, 3)
    assert len(p.ids) == 4096
    k0, k1 = p.def_span
    assert p.ids[k0 + 1 : k1] == p.answer
    assert p.ids[-1:] == p.ids[k0 : k0 + 1]  # the query names the definition's key
    assert p.ids[-3:-1] == list(task.query_prefix)[-2:]
    assert abs(p.distance - 2500) < 4 * task.def_len + 8
    assert p.distance == len(p.ids) - k0


def test_heldout_keys_and_values_never_appear_in_training_definitions(task):
    held = load_task(REPO / "models" / "tiny-qwen35-trained" / "tokenizer.json", "heldout")
    trained = set(task.keys.tolist()) | set(task.values.tolist())
    judged = set(held.keys.tolist()) | set(held.values.tolist())
    assert not trained & judged
    assert len(judged) >= 128 and len(task.values) > 4 * len(held.values)
    x, mask = training_window(task, corpus(), np.random.default_rng(3), 2048, 40)
    assert not set(x[mask > 0].tolist()) & judged
    with pytest.raises(ValueError, match="split"):
        load_task(REPO / "models" / "tiny-qwen35-trained" / "tokenizer.json", "test")
