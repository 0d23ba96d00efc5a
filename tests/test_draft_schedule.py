"""The adaptive draft-count choice against simulated step costs (no model: the schedule only sees
timings and token counts, so its behaviour near break-even and under noise is testable exactly)."""

from __future__ import annotations

import random

from vllm_mlx_mtp_routing.text_engine.draft_schedule import DraftSchedule, bucket_of


def simulate(sched: DraftSchedule, costs, steps: int, *, batch: int = 4, noise: float = 0.08, seed: int = 0,
             spikes: dict[int, float] | None = None) -> list[int]:
    """costs(step, k) -> (tokens per row-step, seconds per row-step); returns the chosen k per step."""
    rng = random.Random(seed)
    chosen = []
    for t in range(steps):
        k = sched.choose(batch)
        tokens, seconds = costs(t, k)
        seconds *= 1 + rng.uniform(-noise, noise)
        seconds *= (spikes or {}).get(t, 1.0)
        sched.record(batch, k, tokens, seconds)
        chosen.append(k)
    return chosen


def mtp_pays(t, k):  # a = 0.9 at a verify costing 1.4 plain steps: 1.36x
    return (1.9, 0.014) if k else (1.0, 0.010)


def mtp_loses(t, k):  # 1.9 tokens for 2.5 plain steps: 0.76x
    return (1.9, 0.025) if k else (1.0, 0.010)


def tie(t, k):  # within 1% either way
    return (1.9, 0.019) if k else (1.0, 0.010)


def test_buckets():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_drafts_where_it_pays_and_not_where_it_loses():
    won = simulate(DraftSchedule(1), mtp_pays, 2000)
    assert won[100:].count(1) / len(won[100:]) > 0.97
    sched = DraftSchedule(1)
    lost = simulate(sched, mtp_loses, 2000)
    # Explorations of the losing choice back off: 16, 32, ..., 256 steps apart.
    assert lost.count(1) <= sched.explore_steps * (5 + 2000 // 256) + 1


def test_near_break_even_neither_flips_nor_keeps_exploring():
    for seed in range(5):
        sched = DraftSchedule(1)
        chosen = simulate(sched, tie, 3000, seed=seed)
        # A switch to drafting costs the head a catch-up: near a tie it may happen, not often.
        assert sched.switches <= 3000 // 150
        # Once settled, explorations have backed off: few changes of choice at all (exploring
        # every 16 steps, as the schedule did before it backed off near ties, is ~150 here).
        settled = chosen[500:]
        changes = sum(a != b for a, b in zip(settled, settled[1:]))
        assert changes <= len(settled) // 64


def test_the_current_choice_follows_a_drop_in_acceptance_at_once():
    def drop(t, k):
        return mtp_pays(t, k) if t < 600 else ((1.1, 0.014) if k else (1.0, 0.010))

    chosen = simulate(DraftSchedule(1), drop, 800)
    assert chosen[550:600].count(1) >= 48
    assert chosen[640:].count(0) / len(chosen[640:]) > 0.9


def test_a_choice_that_starts_paying_is_found_by_exploration():
    def rise(t, k):
        return mtp_loses(t, k) if t < 1000 else mtp_pays(t, k)

    sched = DraftSchedule(1, max_explore_every=256)
    chosen = simulate(sched, rise, 1600)
    assert chosen[900:1000].count(1) <= 4
    first = 1000 + next(i for i, k in enumerate(chosen[1000:]) if k == 1)
    assert first <= 1000 + 256 + 1
    # After a clear change explorations restart at 16 steps apart and back off again.
    after = chosen[first + 20 :]
    assert after.count(0) <= 6 * sched.explore_steps


def test_a_load_spike_does_not_flip_the_choice():
    sched = DraftSchedule(1)
    spikes = {t: 50.0 for t in range(300, 1200, 97)}
    chosen = simulate(sched, mtp_pays, 1200, spikes=spikes)
    assert sched.switches == 0
    assert chosen[100:].count(1) / len(chosen[100:]) > 0.97


def test_larger_k_is_chosen_where_it_pays_more():
    def costs(t, k):
        return [(1.0, 0.010), (1.9, 0.014), (2.7, 0.017)][k]

    chosen = simulate(DraftSchedule(2), costs, 1500)
    assert chosen[200:].count(2) / len(chosen[200:]) > 0.95


def test_a_slow_phase_of_the_machine_does_not_flip_the_choice():
    """Every step 3x slower for 150 steps (a launch-bound GPU whose host is busy): both arms slow
    alike, so comparing the challenger with the current arm's latest steps keeps the choice."""
    def slow_phase(t, k):
        tokens, seconds = mtp_pays(t, k)
        return tokens, seconds * (3.0 if 530 <= t < 680 else 1.0)

    for seed in range(5):
        sched = DraftSchedule(1)
        chosen = simulate(sched, slow_phase, 1000, seed=seed)
        assert sched.switches == 0
        assert chosen[450:1000].count(0) <= 4 * sched.explore_steps


def test_a_challengers_old_yield_does_not_keep_it_out():
    """Drafting yielded little for a while (short requests: rows stop drafting near their end), then
    pays: the next exploration measures its yield afresh and switches."""
    def short_then_long(t, k):
        return ((1.1 if t < 800 else 1.9), 0.014) if k else (1.0, 0.010)

    sched = DraftSchedule(1)
    chosen = simulate(sched, short_then_long, 1400)
    assert chosen[600:800].count(1) <= 2 * sched.explore_rows
    first = 800 + next(i for i, k in enumerate(chosen[800:]) if k == 1)
    assert first <= 800 + 256 + 1
    # After a clear change explorations restart at 16 steps apart and back off again.
    after = chosen[first + 20 :]
    assert after.count(0) <= 6 * sched.explore_steps


def test_a_dip_in_acceptance_does_not_keep_drafting_off():
    """Each request's first steps accept half as often: the schedule may switch to plain there,
    but must come back soon (a switch to fewer drafts shortens the interval; doubled instead, it
    held plain for up to 256 steps and lost 4-6% against always drafting)."""
    def dips(t, k):
        return ((1.5 if t % 70 < 15 else 1.95), 0.016) if k else (1.0, 0.010)

    always = sum(dips(t, 1)[0] for t in range(3000)) / sum(dips(t, 1)[1] for t in range(3000))
    for seed in range(5):
        chosen = simulate(DraftSchedule(1), dips, 3000, batch=1, seed=seed)
        rate = sum(dips(t, k)[0] for t, k in enumerate(chosen)) / sum(dips(t, k)[1] for t, k in enumerate(chosen))
        assert rate > 0.98 * always
