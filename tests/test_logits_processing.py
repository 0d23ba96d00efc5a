"""Per-row logits processing and logprobs on the text engine, fp32 tiny Qwen3.5, plain and MTP.

References are computed here, independently of the engine: a direct forward pass of the whole
sequence at every position, the penalties in numpy, argmax. MTP acceptance is forced with a draft
hook proposing the row's true continuation (from a plain run with the same options) for a planned
number of leading drafts per step, the rest corrupted, so rows accept and reject at different steps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors
from vllm_mlx.api.tool_calling import build_json_logits_processor

from logits_reference import direct_logits, generated_logprobs, reference_greedy
from support.draft_hook import hooked_decode
from vllm_mlx_mtp_routing.text_engine.detokenize import eos_ids_of
from vllm_mlx_mtp_routing.text_engine.logits_processing import fork_options
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.shared_prefill import SharedPrefill
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import TextRequest

PREFILL = 16


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 3000, size=n).tolist() for n in lengths]


def run(bundle, tok, jobs, decode=None, errors=None):
    """jobs: [(arrival_step, prompt, options)] -> per job (token ids, logprob entries or None); a failed
    job's error goes to ``errors`` (by index) when given, else fails the test."""
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=8, prefill_step_size=PREFILL, decode=decode)
    pending, step, outs = sorted(range(len(jobs)), key=lambda i: jobs[i][0]), 0, {}
    while pending or sched.has_work():
        while pending and jobs[pending[0]][0] <= step:
            i = pending.pop(0)
            sched.add(TextRequest(str(i), jobs[i][1], jobs[i][2]))
        for out in sched.step():
            ids, lps = outs.setdefault(int(out.request_id), ([], []))
            if errors is not None and out.finish_reason == "error":
                errors[int(out.request_id)] = out.error
            assert errors is not None or out.finish_reason != "error", out.error
            ids += out.new_token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                lps += out.logprobs
        step += 1
    return [outs[i] for i in range(len(jobs))]


PENALTIES = [
    dict(presence_penalty=2.0),
    dict(frequency_penalty=1.5),
    dict(repetition_penalty=1.8),
    dict(presence_penalty=-1.0, frequency_penalty=0.7, repetition_penalty=1.3),
]


def test_each_penalty_matches_reference_and_applies_to_its_row_only(tiny):
    bundle, tok = tiny
    # Random weights seldom repeat a token, so a penalty bites late if at all; with these prompts row 1's greedy
    # output starts with a prompt token (the repetition penalty changes it at once) and repeats a token of its own
    # at the fourth (presence and frequency change it there): every penalty changes the output within 8 tokens.
    prompts = _prompts([6, 19, 33, 4], seed=17)
    n = 8
    plain = [ids for ids, _ in run(bundle, tok, [(0, p, SamplingOptions(max_tokens=n)) for p in prompts])]
    eos = eos_ids_of(tok)
    for pen in PENALTIES:
        # the penalty on rows 0-2; row 3 is plain in the same batch and must not change
        jobs = [(0, p, SamplingOptions(max_tokens=n, **(pen if j < 3 else {}))) for j, p in enumerate(prompts)]
        got = [ids for ids, _ in run(bundle, tok, jobs)]
        assert got[3] == plain[3]
        for i in range(3):
            ref = reference_greedy(
                bundle.model, prompts[i], n, presence=pen.get("presence_penalty", 0.0),
                frequency=pen.get("frequency_penalty", 0.0), repetition=pen.get("repetition_penalty", 1.0), eos=eos,
            )
            assert got[i] == ref, (pen, i)
        assert got[:3] != plain[:3], pen  # the penalty really changed the output


def test_logprobs_equal_log_softmax_of_a_direct_forward(tiny):
    bundle, tok = tiny
    prompts = _prompts([5, 21], seed=1)
    opts = [SamplingOptions(max_tokens=10, logprobs=True, top_logprobs=5),
            SamplingOptions(max_tokens=10, logprobs=True, repetition_penalty=1.5)]  # processing does not touch logprobs
    for (ids, lps), prompt, o in zip(run(bundle, tok, [(0, p, o) for p, o in zip(prompts, opts)]), prompts, opts):
        ref = generated_logprobs(bundle.model, prompt, ids)
        assert [e.token for e in lps] == ids
        np.testing.assert_allclose([e.logprob for e in lps], ref[np.arange(len(ids)), ids], atol=1e-4)
        for e, r in zip(lps, ref):
            assert len(e.top) == o.top_logprobs
            if e.top:
                np.testing.assert_allclose([v for _, v in e.top], np.sort(r)[::-1][: o.top_logprobs], atol=1e-4)
                assert all(abs(r[t] - v) < 1e-4 for t, v in e.top)


def _json_options(tok, n=48):
    return SamplingOptions(max_tokens=n, logits_processors=[build_json_logits_processor({"type": "json_object"}, tok)])


def test_host_processors_json_and_logit_bias_per_row(tiny):
    bundle, tok = tiny
    prompts = _prompts([3, 17, 9], seed=0)
    plain = run(bundle, tok, [(0, p, SamplingOptions(max_tokens=12)) for p in prompts])
    banned = plain[2][0][0]  # row 2's greedy first token
    bias = make_logits_processors(logit_bias={banned: -100.0})
    jobs = [(0, prompts[0], SamplingOptions(max_tokens=12)), (0, prompts[1], _json_options(tok)),
            (0, prompts[2], SamplingOptions(max_tokens=12, logits_processors=bias))]
    got = run(bundle, tok, jobs)
    assert got[0][0] == plain[0][0]  # a plain row in the same batch is untouched
    eos = eos_ids_of(tok)
    assert got[1][0][-1] in eos
    json.loads(tok.decode(got[1][0][:-1]))  # valid JSON, ended by the processor's own EOS
    assert banned not in got[2][0] and got[2][0] != plain[2][0][:12]
    assert got[2][0] == reference_greedy(bundle.model, prompts[2], 12, bias={banned: -100.0}, eos=eos)


class Oracle:
    """Draft hook: a row proposes ``plan[i][n]`` true tokens at its n-th draft, then wrong ones."""

    def __init__(self, prompts, truths, k, vocab, seed):
        self.prompts, self.truths, self.k, self.vocab = prompts, truths, k, vocab
        self.table = np.random.default_rng(seed).integers(0, k + 1, size=(len(prompts), 256))
        self.calls = [0] * len(prompts)

    def __call__(self, histories, drafts):
        out = []
        for h, d in zip(histories, drafts):
            if d is None:
                out.append(None)
                continue
            i = max((i for i, p in enumerate(self.prompts) if h[: len(p)] == p), key=lambda i: len(self.prompts[i]))
            truth = (self.truths[i][len(h) : len(h) + self.k] + [0] * self.k)[: self.k]
            good = int(self.table[i, self.calls[i]])
            self.calls[i] += 1
            out.append(truth[:good] + [(t + 1) % self.vocab for t in truth[good:]])
        return out


class Recorder:
    """A stateful processor that notes every token context it is called with (and changes nothing)."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def __call__(self, tokens, logits):
        self.calls.append(tokens.tolist())
        return logits


def _options(kind, tok, n, banned=None):
    if kind == "json":
        return _json_options(tok, n)
    if kind == "bias":
        return SamplingOptions(max_tokens=n, logits_processors=make_logits_processors(logit_bias={banned: -100.0}))
    if kind == "penalties":
        return SamplingOptions(max_tokens=n, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.4)
    if kind == "logprobs":
        return SamplingOptions(max_tokens=n, logprobs=True, top_logprobs=3, logits_processors=[Recorder()])
    return SamplingOptions(max_tokens=n)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_with_processing_equals_plain_alone_and_batched(tiny, k):
    bundle, tok = tiny
    kinds = ["json", "bias", "penalties", "logprobs"]
    prompts = _prompts([3, 17, 9, 30], seed=0)
    n = 16
    banned = run(bundle, tok, [(0, prompts[1], SamplingOptions(max_tokens=1))])[0][0][0]
    plain = run(bundle, tok, [(0, p, _options(kd, tok, n, banned)) for p, kd in zip(prompts, kinds)])
    longer = run(bundle, tok, [(0, p, _options(kd, tok, n + k + 1, banned)) for p, kd in zip(prompts, kinds)])
    truths = [p + ids for p, (ids, _) in zip(prompts, longer)]
    vocab = bundle.model.args.vocab_size
    for arrivals in ([0, 0, 0, 0], [0, 2, 3, 5]):
        decode = hooked_decode(bundle.mtp, Oracle(prompts, truths, k, vocab, seed=k), k=k, adaptive=False)
        opts = [_options(kd, tok, n, banned) for kd in kinds]
        got = run(bundle, tok, [(a, p, o) for a, p, o in zip(arrivals, prompts, opts)], decode)
        assert [ids for ids, _ in got] == [ids for ids, _ in plain]
        hist = decode.accepted_histogram
        assert decode.accepted > 0 and hist[0] > 0 and sum(hist[1:]) > 0  # accepted and rejected drafts
        # logprobs: one per token, as plain decoding computed them
        np.testing.assert_allclose([e.logprob for e in got[3][1]], [e.logprob for e in plain[3][1]], atol=1e-4)
        # the processor saw exactly the contexts plain decoding gives it, never a rolled-back draft
        assert opts[3].logits_processors[0].calls == [ids[:j] for ids in [plain[3][0]] for j in range(len(ids))]
    for i, kd in enumerate(kinds):  # alone
        decode = hooked_decode(bundle.mtp, Oracle(prompts[i : i + 1], truths[i : i + 1], k, vocab, seed=i), k=k, adaptive=False)
        assert run(bundle, tok, [(0, prompts[i], _options(kd, tok, n, banned))], decode)[0][0] == plain[i][0]
        assert decode.accepted > 0


def test_sampled_rows_with_a_mask_stay_inside_it_under_mtp(tiny):
    """Speculative sampling against the processed distribution: drafts outside the allowed set are
    never kept, with the hook proposing them every step."""
    bundle, tok = tiny
    allowed = [101, 202, 303]
    vocab = bundle.model.args.vocab_size
    bias = {t: -1e9 for t in range(vocab) if t not in allowed}

    def hook(histories, drafts):
        return [None if d is None else [allowed[len(h) % 3], 7, 8][: len(d)] for h, d in zip(histories, drafts)]

    decode = hooked_decode(bundle.mtp, hook, k=3, adaptive=False)
    opts = [SamplingOptions(max_tokens=20, temperature=1.0, seed=s, logits_processors=make_logits_processors(logit_bias=bias))
            for s in range(3)]
    got = run(bundle, tok, [(0, p, o) for p, o in zip(_prompts([4, 9, 14]), opts)], decode)
    assert all(set(ids) <= set(allowed) and len(ids) == 20 for ids, _ in got)
    assert decode.accepted > 0


def test_fork_options_gives_each_row_its_own_processor_state(tiny):
    bundle, tok = tiny
    prompts = _prompts([3, 9], seed=0)
    base = _json_options(tok, 24)
    alone = [run(bundle, tok, [(0, p, _json_options(tok, 24))])[0][0] for p in prompts]
    got = run(bundle, tok, [(0, prompts[0], base), (0, prompts[1], fork_options(base))])
    assert [ids for ids, _ in got] == alone


def test_pure_processing_steers_the_heads_drafts(tiny):
    """A row's penalties and logit bias also shape the MTP head's drafts (they depend on tokens and logits
    alone): with all but three tokens masked, the random head's drafts land among them and get accepted,
    where its raw argmax over the whole vocabulary almost never would. Output equals plain decoding."""
    bundle, tok = tiny
    allowed = [101, 202, 303]
    bias = {t: -1e9 for t in range(bundle.model.args.vocab_size) if t not in allowed}
    opts = lambda: SamplingOptions(max_tokens=24, logits_processors=make_logits_processors(logit_bias=bias), frequency_penalty=0.5)  # noqa: E731
    prompts = _prompts([4, 11])
    plain = run(bundle, tok, [(0, p, opts()) for p in prompts])
    decode = MTPDecode(bundle.mtp, k=2, adaptive=False)
    assert run(bundle, tok, [(0, p, opts()) for p in prompts], decode) == plain
    assert decode.accepted >= decode.drafted / 4


class Failing:
    """A processor that raises at its third call (e.g. a grammar left with no allowed token)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, tokens, logits):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("no allowed token")
        return logits


@pytest.mark.parametrize("mtp", [False, True])
def test_a_processor_fault_fails_its_row_alone(tiny, mtp):
    bundle, tok = tiny
    prompts = _prompts([5, 12, 7], seed=4)
    plain = run(bundle, tok, [(0, p, SamplingOptions(max_tokens=10)) for p in prompts])
    decode = MTPDecode(bundle.mtp, k=2, adaptive=False) if mtp else None
    errors: dict[int, str] = {}
    jobs = [(0, prompts[0], SamplingOptions(max_tokens=10)), (0, prompts[1], SamplingOptions(max_tokens=10, logits_processors=[Failing()])),
            (0, prompts[2], SamplingOptions(max_tokens=10, presence_penalty=0.0))]
    got = run(bundle, tok, jobs, decode, errors)
    assert list(errors) == [1] and "no allowed token" in errors[1]
    assert got[0] == plain[0] and got[2] == plain[2]


def test_sampled_rows_under_mtp_keep_the_processed_distribution(tiny):
    """Speculative sampling of processed rows: with the hook drafting one fixed token every step, a
    row's first token must still follow the processed distribution p (accepted with p(d), else drawn
    from p without d). 256 seeded rows against p from a direct forward, repetition penalty and mask applied;
    the rows are one request's (its prompt prefilled once, shared_prefill.py), so the time goes to the decode."""
    bundle, tok = tiny
    prompt = _prompts([6], seed=7)[0]
    allowed = [101, 202, 303, 404]
    bias = {t: -1e9 for t in range(bundle.model.args.vocab_size) if t not in allowed}
    x = direct_logits(bundle.model, prompt)[-1]
    seen = sorted(set(prompt))
    x[seen] = np.where(x[seen] < 0, x[seen] * 1.3, x[seen] / 1.3)
    p = np.exp(x[allowed] - x[allowed].max())
    p /= p.sum()

    def hook(histories, drafts):
        return [None if d is None else [allowed[0]] * len(d) for d in drafts]

    decode = hooked_decode(bundle.mtp, hook, k=1, adaptive=False)
    opts = lambda s: SamplingOptions(max_tokens=2, temperature=1.0, seed=s, repetition_penalty=1.3,  # noqa: E731
                                     logits_processors=make_logits_processors(logit_bias=bias))
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=256, prefill_step_size=PREFILL, decode=decode)
    share = SharedPrefill(256)
    for s in range(256):
        sched.add(TextRequest(str(s), prompt, opts(s), share=share))
    firsts = []
    while sched.has_work():
        firsts += [o.token_ids[0] for o in sched.step() if o.finished]
    freq = np.array([firsts.count(t) for t in allowed]) / len(firsts)
    assert len(firsts) == 256 and 0 < decode.accepted < decode.drafted  # the draft was kept and rejected
    assert sched.stats()["shared_prefill_rows"] == 255
    assert np.abs(freq - p).sum() / 2 < 0.08, (freq, p)
