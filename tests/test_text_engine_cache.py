"""BatchCache / RaggedKVCache: rows of any length in one forward, joins, drops, per-row rollback."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from vllm_mlx_mtp_routing.text_engine.batch_cache import BatchCache, RaggedKVCache


@pytest.fixture(scope="module")
def model(tiny_vlm_fp32):
    from mlx_vlm import load
    from vllm_mlx.text_model_from_vlm import build_text_model

    vlm, _ = load(str(tiny_vlm_fp32))
    return build_text_model(vlm, tiny_vlm_fp32, enable_mtp=False)


def _prefilled(model, prompt):
    cache = model.make_cache()
    if prompt:
        model(mx.array(prompt)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def _batch(model, prompts):
    bc = BatchCache(model)
    for p in prompts:
        bc.add_row(_prefilled(model, p))
    return bc


def _step(model, bc, tokens):
    """Feed tokens [B][S]; logits [B, S, V]."""
    logits = model(mx.array(tokens), cache=bc.layers)
    mx.eval(logits, bc.state())
    return logits


PROMPTS = [[], [5, 9, 300], list(range(40, 340))]  # an empty row, a short one, one over 256


def test_rows_of_any_length_equal_single_sequence(model):
    bc = _batch(model, PROMPTS)
    assert bc.lengths() == [0, 3, 300]
    nxt = [[17], [18], [19]]
    batched = _step(model, bc, nxt)
    for i, p in enumerate(PROMPTS):
        single = model(mx.array([p + nxt[i]]), cache=_prefilled(model, []))[:, -1]
        assert mx.allclose(batched[i, -1], single[0], atol=1e-4)
        assert mx.argmax(batched[i, -1]).item() == mx.argmax(single[0]).item()
    assert bc.lengths() == [1, 4, 301]


def test_multi_token_forward_equals_single_steps(model):
    """What MTP verification needs: [token, draft_1..k] per row in one forward."""
    run = [[21, 22, 23], [31, 32, 33], [41, 42, 43]]
    multi = _step(model, _batch(model, PROMPTS), run)
    bc = _batch(model, PROMPTS)
    singles = [_step(model, bc, [[r[s]] for r in run])[:, 0] for s in range(3)]
    assert mx.allclose(multi, mx.stack(singles, axis=1), atol=1e-4)


def test_per_row_rollback(model):
    """Verify 3 tokens per row, keep a different prefix per row, continue: as if never fed."""
    run = [[21, 22, 23], [31, 32, 33], [41, 42, 43]]
    keep = [1, 3, 0]
    # Gated-delta state after each prefix length, captured by feeding one token at a time.
    bc = _batch(model, PROMPTS)
    states = [[list(c.cache) for c in bc.layers if isinstance(c, ArraysCache)]]
    for s in range(3):
        _step(model, bc, [[r[s]] for r in run])
        states.append([list(c.cache) for c in bc.layers if isinstance(c, ArraysCache)])

    bc = _batch(model, PROMPTS)
    _step(model, bc, run)
    for c in bc.layers:
        if isinstance(c, RaggedKVCache):
            c.trim_rows([3 - k for k in keep])
    linear = [c for c in bc.layers if isinstance(c, ArraysCache)]
    for j, c in enumerate(linear):
        c.cache = [
            mx.concatenate([states[k][j][e][i : i + 1] for i, k in enumerate(keep)])
            for e in range(len(c.cache))
        ]
    assert bc.lengths() == [len(p) + k for p, k in zip(PROMPTS, keep)]
    after = _step(model, bc, [[7], [8], [9]])

    for i, p in enumerate(PROMPTS):
        seq = p + run[i][: keep[i]] + [[7], [8], [9]][i]
        ref = model(mx.array([seq]), cache=_prefilled(model, []))[0, -1]
        assert mx.allclose(after[i, -1], ref, atol=1e-4)


def test_filter_and_join_keep_rows_intact(model):
    bc = _batch(model, PROMPTS)
    bc.filter([2, 0])
    assert bc.lengths() == [300, 0] and bc.batch_size == 2
    bc.add_row(_prefilled(model, [77, 78]))
    out = _step(model, bc, [[5], [6], [7]])
    for row, seq in enumerate([PROMPTS[2] + [5], [6], [77, 78, 7]]):
        ref = model(mx.array([seq]), cache=_prefilled(model, []))[0, -1]
        assert mx.allclose(out[row, -1], ref, atol=1e-4)
    bc.filter([])
    assert bc.batch_size == 0 and bc.nbytes == 0


def test_extract_row_as_kv_cache(model):
    bc = _batch(model, PROMPTS)
    kv = next(c for c in bc.layers if isinstance(c, RaggedKVCache))
    row = kv.extract(1)
    ref = next(c for c in _prefilled(model, PROMPTS[1]) if type(c) is KVCache)
    assert isinstance(row, KVCache) and row.offset == 3
    assert mx.array_equal(row.state[0], ref.state[0])
    assert kv.extract(0).offset == 0 and kv.extract(0).keys is None


def test_rejects_unbatchable_cache_types():
    class M:
        def make_cache(self):
            return [ArraysCache(2), object()]

    with pytest.raises(TypeError):
        BatchCache(M())
    np.testing.assert_equal(RaggedKVCache().size(), 0)


@pytest.mark.parametrize("whole_buffer", [False, True])
def test_whole_buffer_attention_equals_trimmed(model, whole_buffer):
    """Attention over the whole reserved buffer (the CUDA default: one shape per 256 tokens) gives
    what attention over the used slots gives; only the key length differs."""
    bc = BatchCache(model, whole_buffer=whole_buffer)
    for p in PROMPTS:
        bc.add_row(_prefilled(model, p))
    logits = _step(model, bc, [[17, 4], [18, 5], [19, 6]])
    ref = _step(model, _batch(model, PROMPTS), [[17, 4], [18, 5], [19, 6]]) if whole_buffer else logits
    assert mx.allclose(logits, ref, atol=1e-4)
    kv = next(c for c in bc.layers if isinstance(c, RaggedKVCache))
    _, H, _, D = kv.keys.shape
    keys, _ = kv.update_and_fetch(mx.zeros((3, H, 1, D)), mx.zeros((3, H, 1, D)))
    assert keys.shape[2] == (512 if whole_buffer else 303)


def test_skip_rows_moves_positions_not_slots():
    """The MTP head resuming after plain steps: row 0 skips 5 positions; its next key lands in
    its next slot, rotated 5 positions further, and the mask is over slots."""
    kv = RaggedKVCache(whole_buffer=False)
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 1, 3, 4)), mx.ones((1, 1, 3, 4)))
    kv.add_row(c)
    kv.add_row(c)
    kv.skip_rows([5, 0])
    assert kv.offset.tolist() == [8, 3] and kv.lengths == [3, 3]
    mask = kv.make_mask(1)
    assert mask.shape == (2, 1, 1, 4) and mask.all().item()
    kv.update_and_fetch(mx.full((2, 1, 1, 4), 2.0), mx.full((2, 1, 1, 4), 2.0))
    assert kv.lengths == [4, 4] and kv.offset.tolist() == [9, 4]
    assert kv.keys[:, 0, 3, 0].tolist() == [2.0, 2.0]
    kv.filter([0])
    assert kv.offset.tolist() == [9]
    with pytest.raises(ValueError):
        kv.extract(0)


@pytest.mark.parametrize("whole_buffer", [False, True])
def test_a_lone_rows_single_run_is_read_as_a_slice_with_the_gathers_result(model, whole_buffer, monkeypatch):
    """A lone row whose blocks are one run of the pool (alone from the start, or left alone and
    compacted) is read as a slice of the pool: the same logits as the gather, bit for bit, while
    it grows past block and 256-token boundaries and rolls back."""
    gathers = []
    gather = RaggedKVCache._gather
    monkeypatch.setattr(RaggedKVCache, "_gather", staticmethod(lambda k, v, idx: gathers.append(1) or gather(k, v, idx)))

    def run(slice_run: bool) -> tuple[list[mx.array], int]:
        bc = BatchCache(model, whole_buffer=whole_buffer)
        for p in PROMPTS:
            bc.add_row(_prefilled(model, p))
        kvs = [c for c in bc.layers if isinstance(c, RaggedKVCache)]
        for c in kvs:
            c.slice_single_run = slice_run
        out = [_step(model, bc, [[17], [18], [19]])]
        bc.filter([2])  # the 300-token row alone: freed blocks are compacted, its own become one run
        gathers.clear()
        for t in range(30):
            out.append(_step(model, bc, [[t + 7, t + 8]] if t % 3 == 0 else [[t + 7]]))
            if t % 3 == 0:
                for c in kvs:
                    c.trim_rows([1])  # a rejected draft
        return out, len(gathers)

    gathered, n = run(False)
    assert n == 30 * len([c for c in BatchCache(model).layers if isinstance(c, RaggedKVCache)])  # keys and values in one
    out, n = run(True)
    assert n == 0
    for a, b in zip(out, gathered):
        assert mx.array_equal(a, b)
