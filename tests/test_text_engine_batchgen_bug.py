"""KNOWN UPSTREAM BUG, pinned: mlx-lm 0.31.3 BatchGenerator is not exact on hybrid (gated-delta) models.

The text engine does not use BatchGenerator because of this (see text_engine/batch.py). These tests
assert that the bug EXISTS on the pinned mlx-lm; if one fails, upstream changed: re-check whether
BatchGenerator became exact, and update these tests and the note in batch.py.

Root cause: ``BatchGenerator`` prefills new prompts together, right-padded to the longest, and
passes the real lengths to the gated-delta caches with ``ArraysCache.prepare(lengths=...)``. The
batch's caches come from ``ArraysCache.merge`` which, when every cache is empty (always, for new
prompts), sets ``left_padding = zeros(B)``; ``ArraysCache.make_mask`` checks ``left_padding`` before
``lengths`` and returns an all-True mask. ``GatedDeltaNet`` then runs its recurrence over the pad
tokens of every shorter row: the recurrent state (cache[1]) absorbs them. The conv state (cut at
``lengths``) and the attention KV (re-aligned by ``BatchKVCache.finalize``) are right; positions and
RoPE offsets are right.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch, generate_step
from mlx_lm.models.cache import ArraysCache, make_prompt_cache


@pytest.fixture(scope="module")
def model(tiny_vlm_fp32):
    from mlx_vlm import load
    from vllm_mlx.text_model_from_vlm import build_text_model

    vlm, _ = load(str(tiny_vlm_fp32))
    return build_text_model(vlm, tiny_vlm_fp32, enable_mtp=False)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 3000, size=n).tolist() for n in lengths]


def test_bug_merged_empty_arrays_cache_ignores_lengths():
    merged = ArraysCache.merge([ArraysCache(2), ArraysCache(2)])
    assert merged.left_padding is not None and merged.left_padding.tolist() == [0, 0]
    merged.prepare(lengths=[1, 3])
    # Correct would be [[T, F, F], [T, T, T]]: row 0 has one real token and two pad tokens.
    assert merged.make_mask(3).tolist() == [[True, True, True], [True, True, True]]


def test_bug_padded_rows_recurrent_state_absorbs_padding(model):
    short, long = _prompts([5, 23])
    batch = PromptProcessingBatch(model, [0, 1], [make_prompt_cache(model), make_prompt_cache(model)])
    batch.prompt([short, long])

    def alone(p):
        c = make_prompt_cache(model)
        model(mx.array(p)[None], cache=c)
        mx.eval([x.state for x in c])
        return c

    ref_short, ref_long = alone(short), alone(long)
    linear = [i for i, c in enumerate(ref_short) if isinstance(c, ArraysCache)]
    attn = [i for i, c in enumerate(ref_short) if not isinstance(c, ArraysCache)]

    def diff(a, b):
        return mx.abs(a - b).max().item()

    for i in linear:
        conv, rec = batch.prompt_cache[i].cache
        assert diff(rec[0:1], ref_short[i][1]) > 1e-2  # THE BUG: padded row's recurrent state
        assert diff(conv[0:1], ref_short[i][0]) < 1e-6  # conv state is cut at `lengths`: fine
        assert diff(rec[1:2], ref_long[i][1]) < 1e-5  # the longest row has no padding: fine
    for i in attn:  # positions / RoPE / KV of the padded row are right
        k, v = batch.prompt_cache[i].extract(0).state
        rk, rv = ref_short[i].state
        assert diff(k, rk) < 1e-5 and diff(v, rv) < 1e-5


def _batch_generate(model, prompts, n):
    gen = BatchGenerator(model, max_tokens=n)
    uids = gen.insert(prompts)
    out = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


def test_bug_batch_generator_greedy_diverges_and_the_mask_is_the_only_cause(model, monkeypatch):
    prompts = _prompts([3, 17, 40, 9, 64, 28, 5, 50])
    n = 8
    # generate_step is stream_generate's single-sequence core (no tokenizer needed on ids)
    ref = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=n)] for p in prompts]

    diverged = [a != b for a, b in zip(_batch_generate(model, prompts, n), ref)]
    assert any(diverged), "mlx-lm BatchGenerator matched single-sequence generation: bug fixed?"

    # Clearing the stray left_padding when lengths are set makes BatchGenerator exact here.
    original = ArraysCache.prepare

    def prepare(self, lengths=None, **kwargs):
        self.left_padding = None
        original(self, lengths=lengths, **kwargs)

    monkeypatch.setattr(ArraysCache, "prepare", prepare)
    assert _batch_generate(model, prompts, n) == ref

