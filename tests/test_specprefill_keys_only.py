"""SpecPrefill's draft prefill writes its last layer's keys and values only: the caches are bitwise what the draft's
full forward writes, for an attention-only draft and a Qwen3.5-shaped one, and the scores are the same."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import specprefill_speed as S

from vllm_mlx_mtp_routing.specprefill import scoring


def _draft(shape: str, **over: Any) -> Any:
    mx.random.seed(3)
    model, _ = S.random_model(shape, mx.float32)
    for k, v in over.items():
        setattr(model, k, v)
    return model


@pytest.mark.parametrize("shape", ["small-attn", "small-draft"])
def test_keys_only_last_layer_writes_the_full_forwards_caches(shape: str) -> None:
    draft = scoring.prepare_draft(_draft(shape))
    assert scoring._keys_only_last_layer(draft)
    ids = mx.array([[(7 * i + 3) % 4000 + 10 for i in range(70)]], dtype=mx.uint32)
    full, short = make_prompt_cache(draft), make_prompt_cache(draft)
    for start, end in ((0, 32), (32, 69)):  # two chunks: the second reads the first's keys
        scoring.text_model(draft).model(ids[:, start:end], cache=full)
        scoring.prefill_keys(draft, ids[:, start:end], short)
    for a, b in zip(full, short):
        assert a.offset == b.offset if hasattr(a, "offset") else True
        for x, y in zip(a.state, b.state):
            assert mx.array_equal(x, y).item()


def test_scores_equal_with_and_without_the_shortcut() -> None:
    prompt = [(11 * i + 5) % 4000 + 10 for i in range(150)]
    draft = scoring.prepare_draft(_draft("small-attn"))

    def scores() -> Any:
        job = scoring.ScoringJob(draft, prompt, 0, 0.3, 0.0, scoring.SpecPrefillSettings(), 64)
        while not job.done:
            job.advance()
        return job.scores, job.kept

    fast = scores()
    draft._specprefill_keys_only = False  # the full forward
    full = scores()
    assert (fast[0] == full[0]).all() and fast[1] == full[1]


def test_a_last_layer_that_is_not_attention_runs_whole() -> None:
    draft = _draft("small-draft")
    layers = scoring.text_model(draft).model.layers
    layers[-1] = layers[0]  # a gated-delta layer last: its state is the layer's whole computation
    assert not scoring._keys_only_last_layer(draft)
