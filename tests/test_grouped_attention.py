"""Attention split by row length (text_engine/length_groups.py, grouped_attention.py).

The plan is the optimum of its cost model (checked against every partition of small batches); the
grouped call gives, bit for bit, the logits and states of the single call it replaces (fp32 tiny
Qwen3.5, plain [B, 1] steps and [B, 3] verifies with the gated-delta capture, both read modes);
and batched MTP decoding with splits forced at every step stays token-for-token equal to each
request decoded alone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from scheduling import run_schedule
from vllm_mlx_mtp_routing.model.backbone import backbone_forward
from vllm_mlx_mtp_routing.model.kernels.grouped_attention import GroupedAttention
from vllm_mlx_mtp_routing.model.mlx_lm_internals import Attention
from vllm_mlx_mtp_routing.text_engine.batch_cache import BatchCache, RaggedKVCache
from vllm_mlx_mtp_routing.text_engine.length_groups import plan_groups
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode


def _cost(spans, groups, overhead):
    return sum(len(g) * max(spans[i] for i in g) for g in groups) + overhead * (len(groups) - 1)


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _partitions(rest):
        for i in range(len(p)):
            yield p[:i] + [[first] + p[i]] + p[i + 1 :]
        yield [[first]] + p


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_is_the_cheapest_partition(seed):
    rng = np.random.default_rng(seed)
    spans = rng.choice([16, 40, 300, 1200, 16000], size=int(rng.integers(2, 7))).tolist()
    overhead = int(rng.choice([0, 100, 1024, 32768]))
    groups = plan_groups(spans, overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(spans)))
    best = min(_cost(spans, p, overhead) for p in _partitions(list(range(len(spans)))))
    assert _cost(spans, groups, overhead) == best


def test_the_plan_splits_only_where_it_pays():
    assert plan_groups([300, 320, 280, 310], 1024) == [[2, 0, 3, 1]]  # similar rows: one call
    assert plan_groups([300, 16384, 280, 310], 1024) == [[2, 0, 3], [1]]  # the long row alone
    assert plan_groups([300, 16384, 280, 310], 10**6) == [[2, 0, 3, 1]]  # a call dearer than the saving
    assert plan_groups([7, 7], 0) == [[0, 1]]  # ties keep one call


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 3000, size=n).tolist() for n in lengths]


def _batch(model, prompts, whole_buffer):
    bc = BatchCache(model, whole_buffer=whole_buffer)
    for p in prompts:
        c = model.make_cache()
        model(mx.array(p, dtype=mx.uint32)[None], cache=c)
        bc.add_row(c)
    mx.eval(bc.state())
    return bc


def _record_reads(monkeypatch) -> list[tuple[int, ...]]:
    reads: list[tuple[int, ...]] = []
    read_rows = RaggedKVCache.read_rows
    monkeypatch.setattr(RaggedKVCache, "read_rows", lambda self, g: reads.append(g.rows) or read_rows(self, g))
    return reads


def test_the_text_model_and_head_attention_layers_are_grouped(tiny):
    bundle, _ = tiny
    layers = list(bundle.model.model.layers) + list(bundle.mtp.layers)
    attention = [m for layer in layers for _, m in layer.named_modules() if isinstance(m, Attention)]
    assert attention and all(type(m) is GroupedAttention for m in attention)


@pytest.mark.parametrize("whole_buffer", [False, True])
def test_grouped_calls_give_the_single_calls_logits_and_states(tiny, monkeypatch, whole_buffer):
    bundle, _ = tiny
    model = bundle.model
    prompts = _prompts([3, 300, 41, 9], seed=1)
    single, grouped = _batch(model, prompts, whole_buffer), _batch(model, prompts, whole_buffer)
    reads = _record_reads(monkeypatch)
    rng = np.random.default_rng(2)
    for step in range(4):
        S = 1 if step % 2 == 0 else 3  # a plain step, then a verify of [token, 2 drafts]
        inputs = mx.array(rng.integers(10, 3000, size=(4, S)), dtype=mx.uint32)
        outs = []
        for bc, overhead in ((single, 0), (grouped, 1)):
            monkeypatch.setattr(RaggedKVCache, "group_overhead", overhead)
            logits, hidden, captured = backbone_forward(model, inputs, bc.layers, capture=S > 1)
            mx.eval(logits, hidden, bc.state(), [c.states for c in captured])
            outs.append((logits, hidden, bc.state(), [c.states for c in captured]))
            if S > 1:
                bc.rollback(captured, [1, 3, 2, 1], S)
        assert mx.array_equal(outs[0][0], outs[1][0]) and mx.array_equal(outs[0][1], outs[1][1])
        for a, b in zip(outs[0][3], outs[1][3]):
            assert all(mx.array_equal(x, y) for x, y in zip(a, b))
    assert reads and any(len(r) == 1 for r in reads)  # the long row was read apart
    assert single.lengths() == grouped.lengths()


def test_mtp_batched_with_forced_splits_matches_alone(tiny, monkeypatch):
    bundle, tok = tiny
    monkeypatch.setattr(RaggedKVCache, "group_overhead", 1)
    reads = _record_reads(monkeypatch)
    prompts = _prompts([70, 2, 33, 9], seed=3)
    opts = [SamplingOptions(max_tokens=12), SamplingOptions(max_tokens=9),
            SamplingOptions(max_tokens=10, temperature=0.8, seed=7), SamplingOptions(max_tokens=11)]

    def go(jobs):
        finals, _ = run_schedule(bundle.model, tok, jobs, max_num_seqs=4, prefill_step_size=16,
                                 decode=MTPDecode(bundle.mtp, k=2, adaptive=False))
        return {i: f.token_ids for i, f in finals.items()}

    batched = go([(i, p, o) for i, (p, o) in enumerate(zip(prompts, opts))])
    assert reads  # the batch's attention really ran split
    for i, (p, o) in enumerate(zip(prompts, opts)):
        assert go([(0, p, o)])[0] == batched[i], f"request {i}"


def test_a_row_apart_whose_blocks_are_one_run_is_read_as_a_view(tiny, monkeypatch):
    bundle, _ = tiny
    bc = _batch(bundle.model, _prompts([200, 5], seed=4), whole_buffer=False)
    gathered = []
    gather = RaggedKVCache._gather
    monkeypatch.setattr(RaggedKVCache, "_gather", staticmethod(lambda k, v, idx: gathered.append(idx.shape) or gather(k, v, idx)))
    monkeypatch.setattr(RaggedKVCache, "group_overhead", 1)
    cache = next(c for c in bc.layers if isinstance(c, RaggedKVCache))
    plan, _ = cache.groups(1)
    long_row = next(g for g in plan if g.rows == (0,))
    k, _ = cache.read_rows(long_row)
    assert not gathered and k.shape[0] == 1 and k.shape[2] == long_row.span == 201
    assert mx.array_equal(k[..., :200, :], cache.keys[:1, :, :200])
    cache._runs[0] = None  # blocks not in one run: gathered
    assert mx.array_equal(cache.read_rows(long_row)[0][..., :200, :], k[..., :200, :]) and gathered
