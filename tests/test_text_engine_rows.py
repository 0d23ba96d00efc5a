"""Rows whose caches come from elsewhere: ``BatchScheduler.add(request, restored=PrefillState(...))``.

A prefix-cache hit restores single-sequence caches that hold the first P prompt tokens (and, with
MTP, the head's cache and the last hidden state); the rest of the prompt is prefilled on them and
the row joins the batch. Its greedy output must be what it is from scratch, beside other rows, and
the MTP head's pairs must sit at their own positions.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from scheduling import run_schedule
from vllm_mlx_mtp_routing.text_engine.runner import prefill_forward
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import PrefillState, TextRequest

PREFILL = 16


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 3000, size=n).tolist() for n in lengths]


def _snapshot(model, decode, prompt, upto: int) -> PrefillState:
    """What a prefix cache would hold for prompt[:upto], prefilled in the engine's chunks (``decode``: None, plain)."""
    state = PrefillState(backbone=model.make_cache())
    for start in range(0, upto, PREFILL):
        chunk = mx.array(prompt[start : min(start + PREFILL, upto)], dtype=mx.uint32)[None]
        prefill_forward(model, decode.proposer if decode is not None else None, chunk, state)
    return state


def _drive(model, tok, decode, jobs):
    """jobs: [(prompt, restored or None)], all added at step 0 -> token ids per job."""
    sched = BatchScheduler(model, tok, max_num_seqs=8, prefill_step_size=PREFILL, decode=decode)
    for i, (p, st) in enumerate(jobs):
        sched.add(TextRequest(str(i), p, SamplingOptions(max_tokens=12)), restored=st)
    finals = {}
    while sched.has_work():
        for o in sched.step():
            if o.finished:
                assert o.finish_reason == "length", o.error
                finals[int(o.request_id)] = o.token_ids
    assert sched.batch.backbone.batch_size == 0 and all(c.batch_size == 0 for c in sched.batch.head)
    return [finals[i] for i in range(len(jobs))], sched


def _plain(bundle, tok, prompts):
    finals, _ = run_schedule(bundle.model, tok, [(0, p, SamplingOptions(max_tokens=12)) for p in prompts],
                             max_num_seqs=8, prefill_step_size=PREFILL)
    return [finals[i].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("upto", [32, 39])  # a chunk boundary; the whole prompt but its last token
def test_restored_plain_row_equals_fresh(tiny, upto):
    bundle, tok = tiny
    prompts = _prompts([40, 7, 23], seed=1)
    ref = _plain(bundle, tok, prompts)
    state = _snapshot(bundle.model, None, prompts[0], upto)
    out, sched = _drive(bundle.model, tok, None, [(prompts[0], state), (prompts[1], None), (prompts[2], None)])
    assert out == ref
    assert sched.prompt_tokens == sum(len(p) - 1 for p in prompts) - upto  # the snapshot was not redone


@pytest.mark.parametrize("with_head", [True, False])
def test_restored_mtp_row_equals_fresh_and_keeps_head_positions(tiny, with_head):
    bundle, tok = tiny
    prompts = _prompts([40, 5, 21], seed=2)
    ref = _plain(bundle, tok, prompts)
    state = _snapshot(bundle.model, MTPDecode(bundle.mtp, k=2, adaptive=False), prompts[0], 32)
    if not with_head:  # a snapshot of the backbone only: the head skips the positions it lacks
        state = PrefillState(backbone=state.backbone, prefilled=state.prefilled)

    gaps = []

    class Checked(MTPDecode):
        def plan(self, batch):
            # backbone length = head position + pending pairs + skipped pairs, for every row
            head = batch.head[0]
            gaps.append([n - (int(p) + len(r.spec.pending_t) + r.spec.skipped)
                         for n, p, r in zip(batch.backbone.lengths(), head.offset.tolist(), batch.rows)])
            return super().plan(batch)

    decode = Checked(bundle.mtp, k=2, adaptive=False)
    out, _ = _drive(bundle.model, tok, decode, [(prompts[0], state), (prompts[1], None), (prompts[2], None)])
    assert out == ref
    assert gaps and {g for step in gaps for g in step} == {0}
    assert decode.stats()["drafted"] > 0


def test_restored_state_is_checked(tiny):
    bundle, tok = tiny
    prompt = _prompts([20], seed=3)[0]
    sched = BatchScheduler(bundle.model, tok, prefill_step_size=PREFILL)
    state = _snapshot(bundle.model, None, prompt, 16)
    with pytest.raises(ValueError, match="prefilled"):
        sched.add(TextRequest("a", prompt[:16]), restored=copy.copy(state))  # covers the last token too
    with pytest.raises(ValueError, match="hold 16 tokens"):
        sched.add(TextRequest("b", prompt), restored=PrefillState(backbone=state.backbone, prefilled=12))
    with pytest.raises(ValueError, match="backbone"):
        sched.add(TextRequest("c", prompt), restored=PrefillState(prefilled=3))
    assert not sched.has_work()  # a refused state queues nothing


def test_sparse_state_joins_at_its_position(tiny):
    """A sparse prefill kept 12 of the 19 prompt positions it covered: the row's keys stay 12
    (+ what it decodes) and its next token is rotated at position 19."""
    bundle, tok = tiny
    prompt = _prompts([20], seed=5)[0]
    state = _snapshot(bundle.model, None, prompt[7:19], 12)
    state = PrefillState(backbone=state.backbone, prefilled=19, position=19)
    sched = BatchScheduler(bundle.model, tok, prefill_step_size=PREFILL)
    sched.add(TextRequest("s", prompt, SamplingOptions(max_tokens=4)), restored=state)
    sched.step()
    kv = next(c for c in sched.cache.layers if hasattr(c, "trim_rows"))
    assert kv.lengths == [13] and kv.offset.tolist() == [20]
    with pytest.raises(ValueError, match="sparse"):
        sched.add(TextRequest("t", prompt + [5, 6]), restored=PrefillState(backbone=state.backbone, prefilled=19, position=19))
