"""DraftPolicy (plan/observe) without a model: which rows draft, and what a step teaches it."""

from __future__ import annotations

import mlx.core as mx

from vllm_mlx_mtp_routing.text_engine.draft_policy import DraftPolicy
from vllm_mlx_mtp_routing.text_engine.mtp_rows import MTPRowState
from vllm_mlx_mtp_routing.text_engine.sampling import RowSampler, SamplingOptions


def _row(pending: bool = True, generated: int = 0) -> MTPRowState:
    r = MTPRowState(history=[1, 2, 3] + [4] * generated, prompt_len=3)
    if pending:
        r.add_pending(mx.zeros((1, 1, 4)), 0, [3])
    return r


def _sampler(**kw) -> RowSampler:
    return RowSampler(SamplingOptions(max_tokens=kw.pop("max_tokens", 50), **kw))


def test_fixed_policy_drafts_every_row_that_can():
    p = DraftPolicy(2, adaptive=False)
    assert p.draft_count(8) == 2
    rows = [_row(), _row(pending=False), _row(generated=49)]  # no pair yet; at its last token
    k, drafting = p.plan(2, rows, [_sampler(), _sampler(), _sampler()])
    assert k == 2 and drafting == [True, False, False]
    assert DraftPolicy(2, adaptive=False, max_batch_size=4).draft_count(5) == 0


def test_low_acceptance_rows_pause_then_probe():
    p = DraftPolicy(1, adaptive=True, probe_every=3, min_row_acceptance=0.5)
    rows = [_row(), _row()]
    for _ in range(3):  # every draft rejected: the EMA falls below the floor
        p.observe(rows, 1, [True, True], [0, 0], tokens=2, seconds=None, shape=(2, 1))
    assert all(r.ema < 0.5 for r in rows)
    assert p.plan(1, rows, [_sampler(), _sampler()]) == (0, [False, False])
    for _ in range(3):  # plain steps: idle counts up to the probe
        p.observe(rows, 0, [False, False], [0, 0], tokens=2, seconds=None, shape=(2, 0))
    assert p.plan(1, rows, [_sampler(), _sampler()]) == (1, [True, True])


def test_seeded_sampled_rows_stay_plain_under_adaptive_drafting():
    rows = [_row(), _row()]
    samplers = [_sampler(temperature=0.8, seed=3), _sampler()]
    assert DraftPolicy(1, adaptive=True).plan(1, rows, samplers) == (1, [False, True])
    assert DraftPolicy(1, adaptive=False).plan(1, rows, samplers) == (1, [True, True])


def test_only_steady_timed_steps_reach_the_schedule():
    p = DraftPolicy(1, adaptive=True)
    seen = []
    p.schedule.record = lambda *a: seen.append(a)
    rows = [_row()]
    p.observe(rows, 1, [True], [1], tokens=2, seconds=0.01, shape=(1, 1, 256))  # a new shape
    p.observe(rows, 1, [True], [1], tokens=2, seconds=0.01, shape=(1, 1, 256))
    p.observe(rows, 1, [True], [1], tokens=2, seconds=0.01, shape=(1, 1, 256), timed=False)  # head resumed
    p.observe(rows, 1, [True], [0], tokens=1, seconds=None, shape=(1, 1, 256))  # after a join
    assert seen == [(1, 1, 2.0, 0.01)]
