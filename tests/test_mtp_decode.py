"""Batched MTP speculative decoding (text_engine.mtp_decode) on the fp32 tiny Qwen3.5.

Random weights accept ~0% of the head's drafts, so acceptance is forced with a draft hook that
proposes the true greedy continuation (from a plain run) with a planned number of correct leading
drafts per row and step, the rest corrupted: rows accept and reject at different steps, and each
row must advance by exactly its own planned count while the output stays token-for-token equal
to decoding without MTP.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_update

from scheduling import run_schedule
from support.draft_hook import HookedProposer, hooked_decode
from support.reference_decode import mtp_greedy_generate
from vllm_mlx_mtp_routing.model.backbone import RECURRENCES, _recurrence_with_states, gated_delta_layer, use_recurrence
from vllm_mlx_mtp_routing.model.mlx_lm_internals import ArraysCache
from vllm_mlx_mtp_routing.text_engine.runner import prefill_forward
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.shared_prefill import SharedPrefill
from vllm_mlx_mtp_routing.text_engine.spec.acceptance import speculative_row
from vllm_mlx_mtp_routing.text_engine.spec.draft_costs import DraftCosts
from vllm_mlx_mtp_routing.text_engine.spec.draft_policy import DraftPolicy
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import TextRequest

PREFILL = 16
LENGTHS = [1, 5, 17, 40]  # a one-token prompt (no head pair at its first step), chunked prompts
MAX_TOKENS = [14, 11, 16, 12]


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 3000, size=n).tolist() for n in lengths]


def run(bundle, tok, jobs, decode=None, max_num_seqs=8):
    """jobs: [(arrival_step, prompt, options)] -> ({index: final TextOutput}, scheduler)."""
    return run_schedule(bundle.model, tok, jobs, max_num_seqs=max_num_seqs, prefill_step_size=PREFILL, decode=decode)


class Oracle:
    """Draft hook: row with prompt i, at its n-th draft, proposes plan(i, n) true tokens then
    corrupted ones. Records the planned count per row of the current step."""

    def __init__(self, prompts, truths, k, vocab, plan):
        self.prompts, self.truths, self.k, self.vocab, self.plan = prompts, truths, k, vocab, plan
        self.calls = [0] * len(prompts)
        self.planned: list[int | None] = []
        self.proposals: dict[tuple[int, int, int], int] = {}  # (prompt, position, j) -> head's draft

    def which(self, history):
        return max((i for i, p in enumerate(self.prompts) if history[: len(p)] == p),
                   key=lambda i: len(self.prompts[i]))

    def __call__(self, histories, drafts):
        out, self.planned = [], []
        for h, d in zip(histories, drafts):
            if d is None:
                out.append(None)
                self.planned.append(None)
                continue
            i = self.which(h)
            for j, t in enumerate(d):
                self.proposals[(i, len(h) + j, j)] = t
            truth = self.truths[i][len(h) : len(h) + self.k]
            good = self.plan(i, self.calls[i])
            self.calls[i] += 1
            truth = truth + [0] * (self.k - len(truth))
            out.append(truth[:good] + [(t + 1) % self.vocab for t in truth[good:]])
            self.planned.append(good if len(self.truths[i]) >= len(h) + self.k else None)
        return out


class Recording(MTPDecode):
    """Logs (the oracle's planned acceptance, the step's result) for every decode step."""

    def __init__(self, head, k=1, *, oracle=None, **kw):
        proposer = {o: kw.pop(o) for o in ("prompt_pairs", "resume_window") if o in kw}
        super().__init__(head, k, proposer=HookedProposer(head, k, oracle, **proposer), **kw)
        self.oracle = oracle
        self.log = []

    def plan(self, batch):
        if self.oracle is not None:
            self.oracle.planned = []
        return super().plan(batch)

    def observe(self, batch, plan, result):
        super().observe(batch, plan, result)
        self.log.append((list(self.oracle.planned) if self.oracle else [], result))


def _plain(bundle, tok, prompts, max_tokens):
    jobs = [(0, p, SamplingOptions(max_tokens=m)) for p, m in zip(prompts, max_tokens)]
    finals, _ = run(bundle, tok, jobs)
    return [finals[i].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_plain_with_per_row_acceptance(tiny, k):
    bundle, tok = tiny
    prompts = _prompts(LENGTHS)
    ref = _plain(bundle, tok, prompts, MAX_TOKENS)
    truths = [p + t for p, t in zip(prompts, _plain(bundle, tok, prompts, [m + k + 1 for m in MAX_TOKENS]))]
    vocab = bundle.model.args.vocab_size

    table = np.random.default_rng(k).integers(0, k + 1, size=(4, 64))  # accepted drafts per row/call

    def plan(i, n):
        return int(table[i, n])

    for arrivals in ([0, 0, 0, 0], [0, 2, 3, 5]):  # all at once; joining mid-decode
        oracle = Oracle(prompts, truths, k, vocab, plan)
        decode = Recording(bundle.mtp, k=k, adaptive=False, oracle=oracle)
        jobs = [(a, p, SamplingOptions(max_tokens=m)) for a, p, m in zip(arrivals, prompts, MAX_TOKENS)]
        finals, _ = run(bundle, tok, jobs, decode)
        assert [finals[i].token_ids for i in range(4)] == ref

        mixed_steps = 0
        for planned, res in decode.log:
            for i, toks in enumerate(res.tokens):
                assert len(toks) == res.accepted[i] + 1  # each row advances by its own count
                if planned and planned[i] is not None:
                    assert res.accepted[i] == planned[i]
            drafting = [a for a, d in zip(res.accepted, res.drafted) if d]
            mixed_steps += len(set(drafting)) > 1
        assert mixed_steps >= 2  # rows accepted different counts within one step
        s = decode.stats()
        assert s["accepted"] > 0 and s["drafted"] == sum(f.mtp_drafted for f in finals.values())
        assert s["accepted"] >= sum(f.mtp_accepted for f in finals.values()) > 0
        assert 0 < s["acceptance_rate"] < 1 and s["steps_with_mtp"] > 0


def test_a_verify_started_in_pieces_is_exact(tiny, monkeypatch):
    """The verify's layers started on the device every n layers while the rest is built (``launch_layers``) change
    when work is launched, never what it computes: rows accepting and rejecting at different steps, joining
    mid-decode, give plain decoding's tokens for every n; and the pieces are launched."""
    from vllm_mlx_mtp_routing.text_engine import runner

    bundle, tok = tiny
    k = 2
    prompts = _prompts(LENGTHS)
    ref = _plain(bundle, tok, prompts, MAX_TOKENS)
    truths = [p + t for p, t in zip(prompts, _plain(bundle, tok, prompts, [m + k + 1 for m in MAX_TOKENS]))]
    table = np.random.default_rng(7).integers(0, k + 1, size=(4, 64))
    launches = {}
    real = mx.async_eval
    for n in (0, 1, 3):
        monkeypatch.setattr(runner, "VERIFY_LAUNCH_LAYERS", {"cpu": n})
        count = [0]

        def counting(*arrays, _count=count):
            _count[0] += 1
            return real(*arrays)

        monkeypatch.setattr(mx, "async_eval", counting)
        oracle = Oracle(prompts, truths, k, bundle.model.args.vocab_size, lambda i, c: int(table[i, c]))
        decode = Recording(bundle.mtp, k=k, adaptive=False, oracle=oracle)
        jobs = [(a, p, SamplingOptions(max_tokens=m)) for a, p, m in zip([0, 2, 3, 5], prompts, MAX_TOKENS)]
        finals, sched = run(bundle, tok, jobs, decode)
        monkeypatch.setattr(mx, "async_eval", real)
        assert sched.runner.launch_layers == n
        assert [finals[i].token_ids for i in range(4)] == ref, n
        launches[n] = count[0]
    assert len(bundle.model.model.layers) == 4  # a verify launches 3 more times at n = 1, once more at n = 3
    assert launches[1] > launches[3] > launches[0]


def test_alone_equals_plain_all_accepted(tiny):
    bundle, tok = tiny
    prompt = _prompts([9], seed=3)[0]
    ref = _plain(bundle, tok, [prompt], [20])
    truths = [prompt + _plain(bundle, tok, [prompt], [24])[0]]
    oracle = Oracle([prompt], truths, 2, bundle.model.args.vocab_size, lambda i, n: 2)
    decode = Recording(bundle.mtp, k=2, adaptive=False, oracle=oracle)
    finals, sched = run(bundle, tok, [(0, prompt, SamplingOptions(max_tokens=20))], decode)
    assert finals[0].token_ids == ref[0]
    assert sched.stats()["steps"] <= 8  # 3 tokens per step instead of 1


def test_head_drafts_match_batch1_reference(tiny):
    """The head's batched ragged cache holds the same pairs as the batch-1 reference: its draft
    for each position equals mtp_greedy_generate's (k = 2, with acceptance forced in both). The
    reference runs the head over the whole prompt, so the engine does too (prompt_pairs=None)."""
    bundle, tok = tiny
    k = 2
    prompts = _prompts([6, 13, 21], seed=5)
    truths = [p + t for p, t in zip(prompts, _plain(bundle, tok, prompts, [20, 20, 20]))]
    oracle = Oracle(prompts, truths, k, bundle.model.args.vocab_size, lambda i, n: (n + i) % (k + 1))
    decode = Recording(bundle.mtp, k=k, adaptive=False, oracle=oracle, prompt_pairs=None)
    run(bundle, tok, [(0, p, SamplingOptions(max_tokens=15)) for p in prompts], decode)

    class ForcedDrafter:  # the real head (its cache, its proposal recorded), the oracle's tokens
        def __init__(self, i):
            self.i, self.n, self.proposals = i, 0, {}

        def make_cache(self):
            return bundle.mtp.make_cache()

        def draft(self, hidden, tokens, cache, k=1):
            d = bundle.mtp.draft(hidden, tokens, cache, k)[0].tolist()
            pos = cache[0].offset + 1  # the first draft's position in the token sequence
            self.proposals.update({(self.i, pos + j, j): t for j, t in enumerate(d)})
            truth = truths[self.i][pos : pos + k]
            good = (self.n + self.i + 1) % (k + 1)
            self.n += 1
            return mx.array([truth[:good] + [(t + 1) % 4096 for t in truth[good:]]])

    compared = 0
    for i, p in enumerate(prompts):
        drafter = ForcedDrafter(i)
        mtp_greedy_generate(bundle.model, drafter, p, 15, k=k, hidden_state_mode=bundle.hidden_state_mode)
        common = drafter.proposals.keys() & oracle.proposals.keys()
        assert all(drafter.proposals[c] == oracle.proposals[c] for c in common)
        compared += len(common)
    assert compared >= 15


def test_all_or_nothing_clamps_rows_and_stays_exact(tiny):
    bundle, tok = tiny
    prompts = _prompts(LENGTHS)
    ref = _plain(bundle, tok, prompts, MAX_TOKENS)
    truths = [p + t for p, t in zip(prompts, _plain(bundle, tok, prompts, [m + 3 for m in MAX_TOKENS]))]
    oracle = Oracle(prompts, truths, 1, bundle.model.args.vocab_size, lambda i, n: int(i != 2 or n % 2))
    decode = Recording(bundle.mtp, k=1, adaptive=False, per_row_acceptance=False, oracle=oracle)
    finals, _ = run(bundle, tok, [(0, p, SamplingOptions(max_tokens=m)) for p, m in zip(prompts, MAX_TOKENS)], decode)
    assert [finals[i].token_ids for i in range(4)] == ref
    for _, res in decode.log:
        assert len({a for a, d in zip(res.accepted, res.drafted) if d}) <= 1


def test_adaptive_falls_back_when_drafts_are_rejected(tiny):
    """Random weights accept ~nothing: once the costs are measured the batch stops drafting (probing now and
    then), output unchanged."""
    bundle, tok = tiny
    prompts = _prompts([7, 12], seed=9)
    ref = _plain(bundle, tok, prompts, [40, 40])
    decode = MTPDecode(bundle.mtp, k=1, adaptive=True)
    finals, _ = run(bundle, tok, [(0, p, SamplingOptions(max_tokens=40)) for p in prompts], decode)
    assert [finals[i].token_ids for i in range(2)] == ref
    s = decode.stats()
    assert s["steps_without_mtp"] > s["steps_with_mtp"] > 0
    assert MTPDecode(bundle.mtp, k=1, max_batch_size=1).policy.draft_count(2) == 0


def test_a_low_acceptance_row_drafts_while_its_batch_does(tiny):
    """Its padding would cost the verify what its draft does: a row whose drafts are always
    rejected keeps drafting beside a row whose drafts are accepted, and stops once alone."""
    bundle, tok = tiny
    prompts = _prompts([6, 9], seed=3)
    ref = _plain(bundle, tok, prompts, [30, 12])
    truths = [p + t for p, t in zip(prompts, _plain(bundle, tok, prompts, [33, 15]))]
    oracle = Oracle(prompts, truths, 1, bundle.model.args.vocab_size, lambda i, n: int(i == 1))
    # Step costs as if measured: drafting pays for the pair whatever one row accepts (1.2 plain
    # steps at batch 2), and alone only at a high acceptance (1.9).
    policy = DraftPolicy(1, costs=DraftCosts(known={1: 1.9, 2: 1.2}))
    decode = Recording(bundle.mtp, k=1, oracle=oracle, policy=policy)
    jobs = [(0, p, SamplingOptions(max_tokens=m)) for p, m in zip(prompts, [30, 12])]
    finals, _ = run(bundle, tok, jobs, decode)
    assert [finals[i].token_ids for i in range(2)] == ref
    pairs = [res.drafted for _, res in decode.log if len(res.drafted) == 2]
    alone = [res.drafted for _, res in decode.log if len(res.drafted) == 1]
    assert len(pairs) >= 5 and alone
    # The rejected row drafts at every step of the pair, though its EMA falls below the floor
    # after three; alone, it stops.
    assert all(d[0] == 1 for d in pairs)
    assert all(d == [0] for d in alone[2:])


# -- sampling ---------------------------------------------------------------------------------


def _chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x): the regularized upper incomplete gamma Q(df/2, x/2) (no scipy here)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # series for P, then Q = 1 - P
        term = total = 1.0 / a
        n = a
        while term > total * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)  # Lentz continued fraction for Q
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was sampled"
    exp = probs[keep] / probs[keep].sum() * counts.sum()
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    return _chi2_sf(stat, int(keep.sum()) - 1)


def test_speculative_row_preserves_the_target_distribution():
    """Accept/resample leaves exactly p: 1000 fixed seeds, chi-square p-value > 1e-3.

    Power (multinomial draws of 1000 through this test, 2000 trials each): resampling from p instead of the
    residual (p - q)+ gives the test's statistic a noncentrality of ~110 and fails it in every trial, as does
    resampling from p without the rejected draft (~85); accepting every draft, or with probability q/p, puts
    ~30% of the samples on token 5, outside p (the support check). A correct sampler fails for 0.1% of seed
    sets (these fixed seeds pass)."""
    p_logits = mx.log(mx.array([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0], [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]]))
    q = mx.array([[0.05, 0.05, 0.1, 0.2, 0.3, 0.3]])
    rng = np.random.default_rng(0)
    n = 1000
    firsts = []
    for s in range(n):
        d = int(rng.choice(6, p=np.array(q[0])))
        key = mx.random.key(s)
        ka, kc = mx.random.split(key)
        acc, cands = speculative_row(p_logits, q, mx.array([d]), ka, kc)
        firsts.append(mx.where(acc[0], d, cands[0]))
    counts = np.bincount(np.array(mx.stack(firsts)), minlength=6)
    assert _chi2_pvalue(counts, np.array(mx.softmax(p_logits[0]))) > 1e-3


def _first_two_exact(bundle, prompt, options):
    """The exact joint distribution of the first two sampled tokens (top-k keeps it small)."""
    from vllm_mlx_mtp_routing.text_engine.sampling import RowSampler

    s = RowSampler(options)
    logits = bundle.model(mx.array([prompt]))[0, -1]
    p1 = np.array(mx.softmax(s.process(logits)))
    joint = {}
    for t1 in np.nonzero(p1)[0]:
        l2 = bundle.model(mx.array([prompt + [int(t1)]]))[0, -1]
        p2 = np.array(mx.softmax(s.process(l2)))
        for t2 in np.nonzero(p2)[0]:
            joint[(int(t1), int(t2))] = p1[t1] * p2[t2]
    return joint


@pytest.mark.parametrize("k", [1, 2])
def test_sampling_with_mtp_matches_the_target_distribution(tiny, k):
    """First two tokens at temperature 0.8, top-k 3: 360 rows (seeds 0..359) with MTP, drafts
    forced to the greedy continuation (accepted with prob p(d)) for half the rows and the head's own
    sampled drafts for the rest; chi-square against the exact joint, p-value > 1e-3. The rows are one
    request's (OpenAI ``n``, its prompt prefilled once: shared_prefill.py), so the test's time goes to the
    decode steps it checks, not to 360 prefills of the same prompt."""
    bundle, tok = tiny
    prompt = _prompts([6], seed=11)[0]
    truth = prompt + _plain(bundle, tok, [prompt], [6])[0]
    n = 360
    opts = [SamplingOptions(max_tokens=2, temperature=0.8, top_k=3, seed=s) for s in range(n)]

    def hook(histories, drafts):  # even rows: the greedy continuation; odd rows: the head's drafts
        return [None if d is None else (truth[len(h) : len(h) + k] if i % 2 == 0 else d)
                for i, (h, d) in enumerate(zip(histories, drafts))]

    decode = hooked_decode(bundle.mtp, hook, k=k, adaptive=False)
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=n, prefill_step_size=PREFILL, decode=decode)
    share = SharedPrefill(n)
    for s in range(n):
        sched.add(TextRequest(str(s), prompt, opts[s], share=share))
    finals = {}
    while sched.has_work():
        finals.update({int(out.request_id): out for out in sched.step() if out.finished})
    assert len(finals) == n and sched.stats()["shared_prefill_rows"] == n - 1
    joint = _first_two_exact(bundle, prompt, opts[0])
    cells = sorted(joint)
    counts = np.zeros(len(cells))
    for f in finals.values():
        counts[cells.index(tuple(f.token_ids))] += 1
    assert _chi2_pvalue(counts, np.array([joint[c] for c in cells])) > 1e-3
    s = decode.stats()
    assert 0.1 < s["acceptance_rate"] < 0.9  # both accept and resample paths ran


def test_seeded_requests_reproduce_alone_and_batched(tiny):
    """Seeds 0, 1, 2: seed 0 is a seed too (a `seed or ...` slip in the row's sampler would draw a random one)."""
    bundle, tok = tiny
    prompts = _prompts([5, 18, 2], seed=2)
    opts = [SamplingOptions(max_tokens=10, temperature=0.9, top_p=0.9, seed=i) for i in range(3)]

    def go(jobs):
        finals, _ = run(bundle, tok, jobs, MTPDecode(bundle.mtp, k=2, adaptive=False))
        return {i: f.token_ids for i, f in finals.items()}

    batched = go([(0, p, o) for p, o in zip(prompts, opts)])
    assert batched == go([(0, p, o) for p, o in zip(prompts, opts)])
    for i, (p, o) in enumerate(zip(prompts, opts)):
        assert go([(0, p, o)])[0] == batched[i]


def test_seeded_sampled_rows_draft_under_the_adaptive_policy_and_reproduce_alone_and_batched(tiny):
    """A seeded sampled row drafts whenever it can, whatever its batch decides for the others: alone,
    beside rows that decode plain (drafting loses by the costs given) and have pending pairs when it
    joins, and under the default policy that learns its costs, it samples the same tokens. Its seed is 0, which the
    policy must count as a seed like any other."""
    bundle, tok = tiny
    prompts = _prompts([5, 18, 9], seed=12)
    seeded = SamplingOptions(max_tokens=12, temperature=0.9, top_p=0.9, seed=0)
    others = [(0, prompts[1], SamplingOptions(max_tokens=30)), (0, prompts[2], SamplingOptions(max_tokens=30, temperature=0.7))]

    def go(jobs, policy=None):
        decode = Recording(bundle.mtp, k=2, policy=policy)
        finals, _ = run(bundle, tok, jobs, decode)
        return finals, decode

    alone, solo = go([(0, prompts[0], seeded)])
    assert solo.stats()["steps_without_mtp"] == 1  # its last token only (a 5-token prompt has a pair)
    losing = {1: 2.9, 2: 2.9, 4: 2.9}
    batched, decode = go([*others, (6, prompts[0], seeded)], DraftPolicy(2, costs=DraftCosts(known=losing)))
    assert batched[2].token_ids == alone[0].token_ids
    drafting = [res.drafted for _, res in decode.log]
    assert any(d == [0, 0] for d in drafting[:6])  # before it joined: plain
    assert all(max(d) == 2 for d in drafting[7:12])  # with it: every row drafts
    learning, _ = go([*others, (3, prompts[0], seeded)])
    assert learning[2].token_ids == alone[0].token_ids


class Pattern(MTPDecode):
    """Drafts on a fixed schedule: `plain` plain steps, then `mtp` drafting steps, repeated.
    Records, per step, every row's backbone length minus (head position + pending pairs)."""

    def __init__(self, *a, plain=11, mtp=3, **kw):
        super().__init__(*a, **kw)
        self.pattern, self.n, self.gaps, self.drafting_plans = (plain, mtp), 0, [], 0

    def plan(self, batch):
        self.n += 1
        k = 0 if (self.n - 1) % sum(self.pattern) < self.pattern[0] else self.k
        planned = self.policy.plan(k, [r.spec for r in batch.rows], [r.sampler for r in batch.rows])
        self.drafting_plans += planned[0] > 0
        return planned

    def observe(self, batch, plan, result):
        super().observe(batch, plan, result)
        if not plan.draft_tokens:
            # A plain step is read after the next one was launched (ModelRunner.decode_ahead): the backbone may
            # already hold that step's token. A drafting step, where the head runs, is never run ahead.
            return
        head = batch.head[0]
        self.gaps.append([n - (int(p) + len(r.spec.pending_t) + r.spec.skipped)
                          for n, p, r in zip(batch.backbone.lengths(), head.offset.tolist(), batch.rows)])


@pytest.mark.parametrize("k", [1, 2])
def test_head_resumes_after_plain_steps_at_the_right_positions(tiny, k):
    """Plain runs longer than the resume window: the head skips the older pairs' positions, so
    every pair still sits at its own position (backbone length = head position + pending pairs +
    skipped pairs, for every row at every step), and the output is the plain output."""
    bundle, tok = tiny
    prompts = _prompts([9, 30, 3], seed=4)
    ref = _plain(bundle, tok, prompts, [40, 40, 40])
    decode = Pattern(bundle.mtp, k=k, adaptive=False, resume_window=4)
    finals, _ = run(bundle, tok, [(a, p, SamplingOptions(max_tokens=40)) for a, p in zip([0, 3, 5], prompts)],
                    decode)
    assert [finals[i].token_ids for i in range(3)] == ref
    # n tokens in the backbone: n pairs (hidden_t, token_t+1), t < n, the last with the token fed next
    assert {g for step in decode.gaps for g in step} == {0}
    s = decode.stats()
    assert s["steps_with_mtp"] > 0 and s["steps_without_mtp"] > 2 * s["steps_with_mtp"]
    # Plain steps run one ahead; a drafting step planned while one was in flight still runs (after it is read): every
    # plan of drafts is a drafting step, none is dropped and planned again.
    assert decode.drafting_plans == s["steps_with_mtp"]


@pytest.fixture(params=sorted(RECURRENCES))
def recurrence(request):
    before = use_recurrence(request.param)
    yield request.param
    use_recurrence(before)


def test_the_captured_recurrence_is_mlx_lms(tiny, recurrence):
    """The verify's recurrence (gates once, one step per position, every state kept), each
    implementation, gives what mlx-lm's gated_delta_update gives over the whole sequence: a mlx-lm
    upgrade that changes the internals it mirrors fails here, not in a benchmark."""
    bundle, _ = tiny
    lin = next(layer.linear_attn for layer in bundle.model.model.layers if layer.is_linear)
    B, S = 3, 4
    keys = mx.random.split(mx.random.key(7), 6)
    q = mx.random.normal((B, S, lin.num_k_heads, lin.head_k_dim), key=keys[0])
    k = mx.random.normal((B, S, lin.num_k_heads, lin.head_k_dim), key=keys[1])
    v = mx.random.normal((B, S, lin.num_v_heads, lin.head_v_dim), key=keys[2])
    a = mx.random.normal((B, S, lin.num_v_heads), key=keys[3])
    b = mx.random.normal((B, S, lin.num_v_heads), key=keys[4])
    state = mx.random.normal((B, lin.num_v_heads, lin.head_v_dim, lin.head_k_dim), key=keys[5])
    y_ref, state_ref = gated_delta_update(q, k, v, a, b, lin.A_log, lin.dt_bias, state)
    y, states = _recurrence_with_states(lin, q, k, v, a, b, state)
    assert len(states) == S
    assert mx.array_equal(y, y_ref) and mx.array_equal(states[-1], state_ref)
    _, state_2 = gated_delta_update(q[:, :2], k[:, :2], v[:, :2], a[:, :2], b[:, :2], lin.A_log, lin.dt_bias, state)
    assert mx.array_equal(states[1], state_2)


def test_the_head_takes_only_the_prompts_last_pairs_at_their_positions(tiny):
    """prompt_pairs: chunks before the prompt's last pairs run the backbone alone; the head starts
    at the chunk that holds them, its keys are exactly the whole-prompt head's keys of those
    positions (rotated where they sit), and decoding from there keeps every pair at its own
    position and the output exact."""
    bundle, tok = tiny
    prompt = _prompts([40], seed=6)[0]

    def prefilled(decode):
        from vllm_mlx_mtp_routing.text_engine.state import PrefillState

        state = PrefillState(backbone=bundle.model.make_cache(), prefill_to=len(prompt) - 1)
        for s in range(0, len(prompt) - 1, PREFILL):
            chunk = mx.array(prompt[s : min(s + PREFILL, len(prompt) - 1)], dtype=mx.uint32)[None]
            prefill_forward(bundle.model, decode.proposer, chunk, state)
        return state

    full = prefilled(MTPDecode(bundle.mtp, k=1, prompt_pairs=None))
    window = prefilled(MTPDecode(bundle.mtp, k=1, prompt_pairs=4))  # positions 35.. sit in the chunk from 32
    [c] = window.head
    assert c.start == 32 and c.offset == full.head[0].offset == len(prompt) - 2
    n = c.offset - c.start
    assert mx.array_equal(c.state[0], full.head[0].state[0][..., 32:, :]) and c.state[0].shape[2] == n
    assert mx.array_equal(window.head_hidden, full.head_hidden)

    prompts = [prompt, *_prompts([9, 33], seed=7)]
    ref = _plain(bundle, tok, prompts, [14, 14, 14])
    decode = Pattern(bundle.mtp, k=2, adaptive=False, prompt_pairs=4, plain=0, mtp=1)
    finals, _ = run(bundle, tok, [(0, p, SamplingOptions(max_tokens=14)) for p in prompts], decode)
    assert [finals[i].token_ids for i in range(3)] == ref
    assert {g for step in decode.gaps for g in step} == {0}
    assert decode.stats()["drafted"] > 0


def test_the_verify_layer_is_mlx_lms_layer(tiny, recurrence):
    """The verify's gated-delta layer with each recurrence (compiled_layer: the whole layer one
    compiled graph) equals mlx-lm's own layer, output and cache, over two calls."""
    bundle, _ = tiny
    lin = next(layer.linear_attn for layer in bundle.model.model.layers if layer.is_linear)
    x = mx.random.normal((3, 2, bundle.model.args.hidden_size), key=mx.random.key(8))
    ours, theirs = ArraysCache(2), ArraysCache(2)
    for _ in range(2):
        out, _, states = gated_delta_layer(lin, x, None, ours, capture=True)
        ref = lin(x, cache=theirs)
        assert mx.array_equal(out, ref) and len(states) == 2
        assert all(mx.array_equal(a, b) for a, b in zip(ours.cache, theirs.cache))


def test_a_row_with_a_penalty_joins_while_a_plain_step_runs_ahead(tiny):
    """Plain steps under MTP run one ahead; a row whose logits processing reads its tokens (a repetition penalty) joins
    while one is in flight: that step is read and the batch goes on serially, every row as without MTP."""
    bundle, tok = tiny
    prompts = _prompts([12, 20, 7], seed=9)
    opts = [SamplingOptions(max_tokens=24), SamplingOptions(max_tokens=24), SamplingOptions(max_tokens=16, repetition_penalty=1.3)]
    jobs = [(a, p, o) for a, p, o in zip([0, 0, 6], prompts, opts)]
    ref, _ = run(bundle, tok, jobs)
    decode = MTPDecode(bundle.mtp, k=1, adaptive=False, max_batch_size=0)  # every step plain
    finals, _ = run(bundle, tok, jobs, decode)
    assert {i: f.finish_reason for i, f in finals.items()} == {i: f.finish_reason for i, f in ref.items()}
    assert [finals[i].token_ids for i in range(3)] == [ref[i].token_ids for i in range(3)]


class CycledCounts(DraftPolicy):
    """Drafts the counts of ``cycle`` in turn, step by step (0: plain), for every row that can."""

    def __init__(self, k, cycle):
        super().__init__(k, adaptive=False)
        self.cycle, self.steps = cycle, 0

    def plan(self, k, rows, samplers):
        count = self.cycle[self.steps % len(self.cycle)]
        self.steps += 1
        return super().plan(count, rows, samplers)


def test_a_draft_count_that_changes_from_step_to_step_stays_exact(tiny):
    """What ``choose_count`` does: a step drafts 2, the next 1 or none; rows join mid-decode; drafts are the true
    continuation (the plain output) up to a random point, so rows keep 0, 1 or 2 of them."""
    bundle, tok = tiny
    prompts = _prompts(LENGTHS, seed=5)
    ref = _plain(bundle, tok, prompts, MAX_TOKENS)
    truths = [p + t for p, t in zip(prompts, _plain(bundle, tok, prompts, [m + 3 for m in MAX_TOKENS]))]
    rng = np.random.default_rng(5)

    def hook(histories, drafts):
        out = []
        for h, d in zip(histories, drafts):
            if d is None:
                out.append(None)
                continue
            truth = next(t for t in truths if t[: len(h)] == h)[len(h) : len(h) + len(d)]
            good = int(rng.integers(0, len(d) + 1))
            out.append(truth[:good] + [(t + 1) % 3000 for t in truth[good:]] + [7] * (len(d) - len(truth)))
        return out

    policy = CycledCounts(2, [2, 1, 0, 1, 2, 2, 0, 1, 1])
    decode = hooked_decode(bundle.mtp, hook, k=2, policy=policy)
    jobs = [(a, p, SamplingOptions(max_tokens=m)) for a, p, m in zip([0, 1, 3, 4], prompts, MAX_TOKENS)]
    finals, _ = run(bundle, tok, jobs, decode)
    assert [finals[i].token_ids for i in range(4)] == ref
    hist = decode.stats()["accepted_histogram"]
    assert policy.steps > 10 and hist[1] > 0 and hist[2] > 0 and hist[0] > 0
