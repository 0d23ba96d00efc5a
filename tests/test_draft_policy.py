"""DraftPolicy (plan/observe) and DraftCosts without a model: which rows draft, what a step teaches
the policy, and its throughput against simulated step costs (the policy only sees timings and
accepted counts, so its behaviour near break-even and under noise is testable exactly)."""

from __future__ import annotations

import random

import mlx.core as mx

from vllm_mlx_mtp_routing.text_engine.sampling import RowSampler, SamplingOptions
from vllm_mlx_mtp_routing.text_engine.spec.draft_costs import DraftCosts, bucket_of
from vllm_mlx_mtp_routing.text_engine.spec.draft_policy import DraftPolicy
from vllm_mlx_mtp_routing.text_engine.spec.mtp_rows import MTPRowState


def _row(pending: bool = True, generated: int = 0) -> MTPRowState:
    r = MTPRowState(history=[1, 2, 3] + [4] * generated, prompt_len=3)
    if pending:
        r.add_pending(mx.zeros((1, 1, 4)), 0, [3])
    return r


def _sampler(**kw) -> RowSampler:
    return RowSampler(SamplingOptions(max_tokens=kw.pop("max_tokens", 10**6), **kw))


def simulate(policy: DraftPolicy, steps: int, *, batch: int = 4, ratio=1.4, acceptance=0.9, noise: float = 0.08,
             seed: int = 0, slow: dict[int, float] | None = None, samplers=None) -> tuple[list[int], float]:
    """ratio(t) / acceptance(t): a drafting step's cost in plain steps and each draft's chance of
    acceptance at step t (or constants). Returns the draft count per step and tokens per plain-step time per row."""
    rng = random.Random(seed)
    rows = [_row() for _ in range(batch)]
    samplers = samplers or [_sampler() for _ in range(batch)]
    chosen, tokens, seconds = [], 0, 0.0
    for t in range(steps):
        r = ratio(t) if callable(ratio) else ratio
        a = acceptance(t) if callable(acceptance) else acceptance
        k, drafting = policy.plan(policy.draft_count(batch), rows, samplers)
        accepted = [sum(1 for _ in range(k) if rng.random() < a) if d else 0 for d in drafting]
        step = 0.01 * (r if k else 1.0) * (1 + rng.uniform(-noise, noise)) * (slow or {}).get(t, 1.0)
        policy.observe(rows, k, drafting, accepted, seconds=step, shape=(batch, k))
        chosen.append(k)
        tokens += batch + sum(accepted)
        seconds += step
    return chosen, tokens / seconds * 0.01 / batch  # 1.0: plain decoding


def test_buckets():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_costs_learn_the_ratio_from_alternating_blocks_through_a_slow_phase():
    costs = DraftCosts(block=3, pairs=3)
    rng = random.Random(1)
    steps = 0
    while costs.learning_arm(4) is not None:
        drafted = costs.learning_arm(4)
        # A phase 3x slower than the rest over 4 steps of the learning: both arms' neighbours see it.
        slow = 3.0 if 7 <= steps < 11 else 1.0
        costs.record(4, drafted, 0.01 * (1.6 if drafted else 1.0) * (1 + rng.uniform(-0.05, 0.05)) * slow)
        steps += 1
    assert steps == 18  # 3 timed steps a block, 3 blocks of each arm
    assert abs(costs.ratio(4) - 1.6) < 0.1
    assert costs.ratio(1) is None and costs.ratio_by_batch() == {1: None, 4: round(costs.ratio(4), 3)}


def test_a_session_whose_every_block_was_cut_short_measures_again():
    """Rows joining and leaving after each block (no steady step of the other arm for a while) restart
    the block, unpaired: a session can end without a ratio. The policy then decided on None (a TypeError
    every step at that batch size); the bucket now starts a new session instead."""
    costs = DraftCosts(block=3, pairs=3)
    for block in range(6):
        for _ in range(3):
            drafted = costs.learning_arm(1)
            costs.record(1, drafted, 0.01)
        if block < 5:
            for _ in range(4 * (3 + 1) + 1):  # past the wait limit: the block restarts on the other arm
                costs.learning_arm(1)
    assert costs.ratio(1) is None
    policy = DraftPolicy(1, costs=costs)
    k, drafting = policy.plan(1, [_row()], [_sampler()])
    assert (k, drafting) == (1, [True])  # a new session's first (drafting) block
    assert costs.learning_arm(1) is not None


def test_drafts_where_it_pays_and_never_where_it_cannot():
    chosen, _ = simulate(DraftPolicy(1), 2000, ratio=1.4, acceptance=0.9)
    assert chosen[100:].count(1) / len(chosen[100:]) > 0.99
    # 2.2 plain steps a draft step: no acceptance pays (1 + k = 2 < 2.2), so no probes either.
    chosen, _ = simulate(DraftPolicy(1), 2000, ratio=2.2, acceptance=0.9)
    assert chosen[:30].count(1) >= 9  # learning: drafting blocks
    assert chosen[40:].count(1) == 0


def test_throughput_within_3_percent_of_the_better_fixed_choice():
    """Across costs and acceptances, on both sides of break-even and at it."""
    for ratio, acc in [(1.3, 0.9), (1.6, 0.9), (1.85, 0.9), (1.9, 0.9), (1.95, 0.9), (2.1, 0.9),
                       (1.5, 0.3), (1.5, 0.5), (1.5, 0.6), (1.2, 0.05)]:
        for seed in range(3):
            _, policy = simulate(DraftPolicy(1), 1500, ratio=ratio, acceptance=acc, seed=seed)
            _, always = simulate(DraftPolicy(1, adaptive=False), 1500, ratio=ratio, acceptance=acc, seed=seed)
            assert policy >= 0.97 * max(always, 1.0), (ratio, acc, seed, policy, always)


def test_k2_weighs_accepted_drafts_per_step():
    # 2.3 plain steps for 1 + 2 * 0.8 = 2.6 tokens: drafting pays at k = 2 though not at k = 1.
    chosen, _ = simulate(DraftPolicy(2), 1000, ratio=2.3, acceptance=0.8)
    assert chosen[100:].count(2) / len(chosen[100:]) > 0.95


def test_a_drop_in_acceptance_turns_drafting_off_and_probes_find_it_again():
    policy = DraftPolicy(1, probe_every=32)
    chosen, _ = simulate(policy, 2400, ratio=1.6, acceptance=lambda t: 0.9 if t < 600 or t >= 1400 else 0.2)
    assert chosen[500:600].count(1) >= 98
    off = chosen[700:1400]
    assert off.count(1) <= len(off) // 32 + 1  # probes only
    # Acceptance came back at 1400: the probes (4 rows' coins every 32 steps) raise every row's
    # estimate, and drafting resumes within ~300 steps.
    assert chosen[1700:].count(1) / len(chosen[1700:]) > 0.97


def test_fixed_policy_drafts_every_row_that_can():
    p = DraftPolicy(2, adaptive=False)
    assert p.draft_count(8) == 2
    rows = [_row(), _row(pending=False), _row(generated=49)]  # no pair yet; at its last token
    k, drafting = p.plan(2, rows, [_sampler(), _sampler(max_tokens=50), _sampler(max_tokens=50)])
    assert k == 2 and drafting == [True, False, False]
    assert DraftPolicy(2, adaptive=False, max_batch_size=4).draft_count(5) == 0


def test_seeded_sampled_rows_draft_whatever_the_batch():
    """A seeded sampled row drafts whenever it can, in a bucket that has learnt drafting loses: its
    drafting then depends on nothing but the row itself."""
    p = DraftPolicy(1)
    simulate(p, 100, batch=2, ratio=2.5)
    assert p.costs.ratio(2) > 2 and p.plan(1, [_row(), _row()], [_sampler(), _sampler()]) == (0, [False, False])
    seeded = _sampler(temperature=0.8, seed=3)
    assert p.plan(1, [_row(), _row()], [seeded, _sampler()]) == (1, [True, True])
    assert p.plan(1, [_row()], [seeded]) == (1, [True])
    assert p.plan(1, [_row(pending=False), _row()], [seeded, _sampler()]) == (0, [False, False])  # it cannot yet
    # Greedy rows with a seed are deterministic anyway: the cost model decides for them.
    assert p.plan(1, [_row(), _row()], [_sampler(seed=3), _sampler()]) == (0, [False, False])


def test_rows_acceptance_and_the_new_rows_estimate():
    p = DraftPolicy(1)
    rows = [_row(), _row()]
    assert p.acceptance(rows[0]) == 1  # nothing measured: optimistic, k
    for _ in range(40):
        p.observe(rows, 1, [True, True], [0, 1], seconds=None, shape=(2, 1))
    assert rows[0].acceptance < 0.1 < 0.9 < rows[1].acceptance
    for _ in range(40):  # plain steps: each row relaxes to every row's estimate
        p.observe(rows, 0, [False, False], [0, 0], seconds=None, shape=(2, 0))
    assert 0.3 < rows[0].acceptance < 0.7 and 0.3 < rows[1].acceptance < 0.7
    assert 0.3 < p.acceptance(_row()) < 0.7  # a new row starts at every row's recent acceptance


def test_only_steady_timed_steps_reach_the_costs():
    p = DraftPolicy(1)
    seen = []
    p.costs.record = lambda *a: seen.append(a)
    rows = [_row()]
    p.observe(rows, 1, [True], [1], seconds=0.01, shape=(1, 1, 256))  # a new shape
    p.observe(rows, 1, [True], [1], seconds=0.01, shape=(1, 1, 256))
    p.observe(rows, 1, [True], [1], seconds=0.01, shape=(1, 1, 256), timed=False)  # head resumed
    p.observe(rows, 1, [True], [0], seconds=None, shape=(1, 1, 256))  # after a join
    p.observe(rows, 0, [False], [0], seconds=0.01, shape=(1, 0, 256))  # a switch
    p.observe(rows, 0, [False], [0], seconds=0.02, shape=(1, 0, 256))
    assert seen == [(1, True, 0.01), (1, False, 0.02)]


def test_near_a_tie_the_cost_ratio_is_refined_until_the_choice_is_right():
    """A first measurement thrown off (every drafting block of it 1.15x slower: a load pattern that
    pairing does not cancel) has drafting losing; near a tie the bucket measures again now and then,
    and its ratio converges on the true one."""
    policy = DraftPolicy(1, refine_every=128)
    slow = {t: 1.15 for t in range(40)}
    rng = random.Random(3)
    rows, samplers, chosen = [_row() for _ in range(2)], [_sampler() for _ in range(2)], []
    for t in range(3000):
        k, drafting = policy.plan(1, rows, samplers)
        accepted = [int(rng.random() < 0.9) if d else 0 for d in drafting]
        seconds = 0.01 * (1.75 * slow.get(t, 1.0) if k else 1.0) * (1 + rng.uniform(-0.05, 0.05))
        policy.observe(rows, k, drafting, accepted, seconds=seconds, shape=(2, k))
        chosen.append(k)
        if t == 60:
            assert policy.costs.ratio(2) > 1.9  # drafting looked like a loss at first
    assert abs(policy.costs.ratio(2) - 1.75) < 0.1
    assert chosen[2000:].count(1) / 1000 > 0.88  # the rest: refining sessions' plain blocks


def test_a_measurement_without_steady_steps_alternates_instead_of_holding_one_arm():
    """Rows join and leave at every step (no step is timed): the bucket's first measurement cannot
    finish, and it must not keep the batch drafting (or plain) for as long as that lasts."""
    policy = DraftPolicy(1)
    rows, samplers = [_row() for _ in range(8)], [_sampler() for _ in range(8)]
    chosen = []
    for _ in range(400):
        k, drafting = policy.plan(1, rows, samplers)
        policy.observe(rows, k, drafting, [1 if d else 0 for d in drafting], seconds=None, shape=(8, k))
        chosen.append(k)
    assert policy.costs.ratio(8) is None
    assert 0.4 < chosen.count(1) / len(chosen) < 0.6


def simulate_counts(policy: DraftPolicy, steps: int, *, ratios: dict[int, float], acceptance: list[float],
                    batch: int = 4, noise: float = 0.05, seed: int = 0) -> tuple[list[int], float]:
    """As ``simulate``, a drafting step of j drafts costing ratios[j] plain steps, draft j accepted with chance
    acceptance[j] when every draft before it was (a verify keeps a prefix)."""
    rng = random.Random(seed)
    rows, samplers = [_row() for _ in range(batch)], [_sampler() for _ in range(batch)]
    chosen, tokens, seconds = [], 0, 0.0
    for _ in range(steps):
        k, drafting = policy.plan(policy.draft_count(batch), rows, samplers)
        accepted = []
        for d in drafting:
            n = 0
            while d and n < k and rng.random() < acceptance[n]:
                n += 1
            accepted.append(n)
        step = 0.01 * (ratios[k] if k else 1.0) * (1 + rng.uniform(-noise, noise))
        policy.observe(rows, k, drafting, accepted, seconds=step, shape=(batch, k))
        chosen.append(k)
        tokens += batch + sum(accepted)
        seconds += step
    return chosen, tokens / seconds * 0.01 / batch


def test_choose_count_takes_the_count_that_pays_most():
    """Launch-bound (a GPU): a second draft costs the verify little, and two drafts pay more than one; compute-bound
    (a CPU): each draft costs its share, and one draft (or none) pays more. The choice lands within 3% of the best
    fixed count's throughput; the estimate per position is the chance of draft j after j - 1 accepted."""
    cases = [({1: 1.45, 2: 1.6}, [0.8, 0.8], 2), ({1: 1.45, 2: 2.3}, [0.8, 0.8], 1),
             ({1: 1.45, 2: 1.6}, [0.8, 0.2], 1), ({1: 2.1, 2: 3.2}, [0.8, 0.8], 0)]
    for ratios, acceptance, best in cases:
        for seed in range(2):
            policy = DraftPolicy(2, choose_count=True)
            chosen, got = simulate_counts(policy, 1500, ratios=ratios, acceptance=acceptance, seed=seed)
            tail = chosen[300:]
            assert tail.count(best) / len(tail) > 0.9, (ratios, acceptance, seed, {j: tail.count(j) for j in (0, 1, 2)})
            fixed = [simulate_counts(DraftPolicy(j, adaptive=False), 1500, ratios=ratios, acceptance=acceptance,
                                     seed=seed)[1] if j else 1.0 for j in (0, 1, 2)]
            assert got >= 0.97 * max(fixed), (ratios, acceptance, seed, got, fixed)
            est = policy.stats()["position_acceptance_estimate"]
            assert abs(est[0] - acceptance[0]) < 0.15
    stats = policy.stats()
    assert set(stats["draft_cost_by_count"]) == {1, 2} and abs(stats["draft_cost_by_count"][2][4] - 3.2) < 0.2


def test_choose_count_off_or_fixed_keeps_one_count():
    assert DraftPolicy(2).counts == [2] and DraftPolicy(2, choose_count=True, adaptive=False).counts == [2]
    assert DraftPolicy(3, choose_count=True).counts == [3, 2, 1]
    seeded = _sampler(temperature=0.8, seed=3)  # a seeded sampled row drafts k, whatever the costs say
    p = DraftPolicy(2, choose_count=True, costs=DraftCosts(known={2: 9.0}))
    assert p.plan(2, [_row(), _row()], [seeded, _sampler()]) == (2, [True, True])


def test_expected_accepted_counts_a_draft_only_after_its_predecessors():
    from vllm_mlx_mtp_routing.text_engine.spec.mtp_rows import expected_accepted

    assert expected_accepted([0.8, 0.5], 2) == 0.8 + 0.8 * 0.5 and expected_accepted([0.8, 0.5], 1) == 0.8
    assert expected_accepted([0.8], 3) == 0.8  # positions never judged add nothing
