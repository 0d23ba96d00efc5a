"""The start-up warm-up of the decode's batch sizes (text_engine/warmup.py), through the engine on the fp32 tiny model
(forced on: on the CPU 'auto' leaves it off)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx_mtp_routing.prefix_cache.cache import PrefixCache
from vllm_mlx_mtp_routing.specprefill import SpecPrefill, SpecPrefillSettings
from vllm_mlx_mtp_routing.text_engine import warmup
from vllm_mlx_mtp_routing.text_engine.engine import TextEngine
from vllm_mlx_mtp_routing.text_engine.runner import ModelRunner
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import TextRequest


class Recording(MTPDecode):
    """Logs (rows, drafts) of every step; the warm-up's twin is a shallow copy, so it logs into the same list."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[tuple[int, int]] = []

    def observe(self, batch, plan, result):
        super().observe(batch, plan, result)
        self.log.append((len(plan.rows), max(result.drafted)))


def finish(engine: TextEngine, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    """Greedy outputs of the prompts, all queued at once, stepped on the engine's scheduler."""
    sched = engine.scheduler
    for i, p in enumerate(prompts):
        sched.add(TextRequest(str(i), p, SamplingOptions(max_tokens=max_tokens)))
    finals = {}
    while sched.has_work():
        for out in sched.step():
            if out.finished:
                finals[int(out.request_id)] = out.token_ids
    return [finals[i] for i in range(len(prompts))]


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(10, 3000, size=int(m)).tolist() for m in rng.integers(2, 30, size=n)]


def test_each_batch_size_takes_a_plain_step_and_a_verify_and_nothing_counts(tiny, tiny_draft_dir) -> None:
    from mlx_lm import load

    bundle, tok = tiny
    decode = Recording(bundle.mtp, k=2, max_batch_size=2)
    cache = PrefixCache(bundle.model, 64 << 20, with_head=True)
    sparse = SpecPrefill(load(str(tiny_draft_dir))[0], SpecPrefillSettings(threshold=0, keep_pct=0.5))  # every prompt
    engine = TextEngine(bundle.model, tok, max_num_seqs=3, prefill_step_size=16, decode=decode, prefix_cache=cache,
                        specprefill=sparse)
    before, cache_before, sparse_before = engine.stats(), cache.stats(), sparse.metrics.stats()
    memory = mx.get_active_memory()
    done = engine.warm_up()
    assert mx.get_active_memory() - memory < 4096  # its rows and caches freed
    # One row joins per size, its step plain; then a verify of k drafts where the server's policy would draft.
    assert decode.log[:5] == [(1, 0), (1, 2), (2, 0), (2, 2), (3, 0)]
    # Then a long row takes the place of one: the two decode while it prefills, it joins, takes two tokens and leaves
    # (its snapshots taken); a follow-up restores one, prefills the rest, joins and leaves the same way. (Plain steps
    # are launched one ahead, so how many two-row steps fall between depends on that.)
    runs = [(step, len(list(same))) for step, same in itertools.groupby(decode.log[5:])]
    assert [step for step, _ in runs] == [(2, 0), (3, 0), (2, 0), (3, 0)] and runs[1][1] == runs[3][1] == 2
    assert done.snapshots >= 2 and done.snapshot_hits >= 1  # in the rehearsal's own cache, dropped (below)
    assert done.batch_sizes == [1, 2, 3] and done.verify_batch_sizes == [1, 2] and done.draft_tokens == 2
    assert done.seconds > 0 and len(done.seconds_by_batch_size) == 3
    after = engine.stats()
    assert after.pop("warmup") == done.stats() and before.pop("warmup") is None
    for s in (before, after):
        s.pop("garbage_collector")  # the process's collections since start, the calibration's as anyone's
    assert after == before  # steps, tokens, histogram, slowest steps, MTP counts and policy, bytes held
    assert after["steps"] == after["tokens_generated"] == after["prompt_tokens_processed"] == 0
    assert after["mtp"]["drafted"] == after["mtp"]["steps_with_mtp"] == 0 and after["mtp"]["draft_cost_by_batch"] == {}
    assert cache.stats() == cache_before and cache_before["lookups"] == 0 and cache_before["entries"] == 0
    assert sparse.metrics.stats() == sparse_before and sparse_before["requests"] == sparse_before["tokens_scored"] == 0
    sched = engine.scheduler
    assert not sched.has_work() and sched.batch.nbytes == 0


def test_plain_decode_warms_each_size_and_max_batch_caps_it(tiny, monkeypatch) -> None:
    from vllm_mlx_mtp_routing.text_engine.batch_cache import RaggedKVCache

    bundle, tok = tiny
    log: list[int] = []
    decode_step, ahead_step = ModelRunner.decode, ModelRunner.decode_ahead

    def recording_decode(self, plan):
        log.append(len(plan.rows))
        return decode_step(self, plan)

    def recording_ahead(self, plan):
        log.append(len(plan.rows))
        return ahead_step(self, plan)

    monkeypatch.setattr(ModelRunner, "decode", recording_decode)
    monkeypatch.setattr(ModelRunner, "decode_ahead", recording_ahead)
    engine = TextEngine(bundle.model, tok, max_num_seqs=4)
    shrunk, compact = [], RaggedKVCache._compact

    def recording(self, force=False):
        before = None if self._pool_k is None else self._pool_k.shape[1]
        compact(self, force)
        shrunk.append(before is not None and self._pool_k.shape[1] < before)

    monkeypatch.setattr(RaggedKVCache, "_compact", recording)
    done = engine.warm_up(max_batch=3)
    assert any(shrunk)  # the long row's leaving compacted the KV pool (its first use is warmed too)
    assert log[:3] == [1, 2, 3] and log[-2:] == [3, 2] and set(log[3:]) <= {2, 3}
    assert done.batch_sizes == [1, 2, 3] and done.verify_batch_sizes == []
    assert done.draft_tokens == 0 and engine.stats()["steps"] == 0


def test_greedy_outputs_are_the_same_with_and_without_the_warm_up(tiny) -> None:
    bundle, tok = tiny
    ps = prompts(4)
    outputs = []
    for warm in (False, True):
        engine = TextEngine(bundle.model, tok, max_num_seqs=3, prefill_step_size=16, decode=MTPDecode(bundle.mtp, k=2, adaptive=False))
        if warm:
            engine.warm_up()
        outputs.append(finish(engine, ps))
        assert engine.stats()["tokens_generated"] == 4 * 8
    assert outputs[0] == outputs[1]


def test_the_engine_warms_up_only_before_it_serves(tiny) -> None:
    bundle, tok = tiny
    engine = TextEngine(bundle.model, tok, max_num_seqs=2)
    engine.scheduler.add(TextRequest("r", [5, 6, 7], SamplingOptions(max_tokens=2)))
    with pytest.raises(RuntimeError, match="before it serves"):
        engine.warm_up()


def test_auto_is_off_on_the_cpu() -> None:
    assert warmup.enabled("on") and not warmup.enabled("off") and not warmup.enabled("auto")
    with pytest.raises(ValueError):
        warmup.enabled("maybe")


def test_a_policy_that_chooses_its_draft_count_warms_a_verify_at_each(tiny) -> None:
    bundle, tok = tiny
    decode = Recording(bundle.mtp, k=2, choose_count=True)
    engine = TextEngine(bundle.model, tok, max_num_seqs=2, prefill_step_size=16, decode=decode)
    done = engine.warm_up()
    assert decode.log[:6] == [(1, 0), (1, 2), (1, 1), (2, 0), (2, 2), (2, 1)]
    assert done.verify_batch_sizes == [1, 2] and engine.stats()["mtp"]["draft_count_by_batch"] == {}
