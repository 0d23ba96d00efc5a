"""A prefix-cache hit changes nothing but the work: greedy output with a hit equals the output
without the cache, token for token (fp32 tiny Qwen3.5), alone and in a batch, for hits at every
kind of boundary (system block, start of a message, end of a prompt, end of a generation), a hit
leaving a one-token suffix, a hit on the whole prompt; with MTP the head continues right after the
hit (its drafts after a hit equal its drafts without one).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from scheduling import run_schedule
from support.draft_hook import hooked_decode
from vllm_mlx_mtp_routing.prefix_cache.cache import PrefixCache
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import TextRequest

PREFILL = 16  # prompts span several chunks; snapshot positions fall inside chunks
MB = 1 << 20


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 3000, size=n).tolist()


SYSTEM = _tokens(37, 1)
HISTORY = _tokens(21, 2)
U1, U2, U3 = _tokens(9, 3), _tokens(13, 4), _tokens(6, 5)


def run(bundle, tok, jobs, *, cache=None, decode=None, max_num_seqs=4):
    finals, sched = run_schedule(
        bundle.model, tok, jobs, max_num_seqs=max_num_seqs, prefill_step_size=PREFILL, decode=decode, prefix_cache=cache
    )
    return [finals[i] for i in range(len(jobs))], sched


def cold(bundle, tok, prompt, max_tokens=10, decode=None):
    outs, _ = run(bundle, tok, [(0, prompt, SamplingOptions(max_tokens=max_tokens))], decode=decode() if decode else None)
    return outs[0].token_ids


def _cache(bundle, decode=None) -> PrefixCache:
    return PrefixCache(bundle.model, 64 * MB, with_head=bool(decode is not None and decode.head_layers))


def test_hits_at_each_boundary_equal_cold_alone(tiny):
    bundle, tok = tiny
    cache = _cache(bundle)
    opts = SamplingOptions(max_tokens=10)
    marks = [(len(SYSTEM), "system"), (len(SYSTEM) + len(HISTORY), "message")]
    first = SYSTEM + HISTORY + U1
    (a,), _ = run(bundle, tok, [(0, first, opts, marks)], cache=cache)
    assert a.cached_tokens == 0
    assert cache.stats()["entries"] >= 3  # system, message, end of prompt (and end of generation)

    cases = {
        "system": (SYSTEM + U2, len(SYSTEM)),
        "message": (SYSTEM + HISTORY + U2, len(SYSTEM) + len(HISTORY)),
        "prompt": (first + U3, len(first) - 1),  # the conversation's next turn extends the prompt
        "generation": (first + a.token_ids + U3, len(first) + len(a.token_ids) - 1),
        "whole prompt": (first, len(first) - 1),
        "one-token suffix": (first + U3[:1], len(first) - 1),  # nothing left to prefill
        "one token to prefill": (first + U3[:2], len(first) - 1),
    }
    for name, (prompt, expect_hit) in cases.items():
        (out,), _ = run(bundle, tok, [(0, prompt, opts)], cache=cache)
        assert out.cached_tokens >= expect_hit, name
        assert out.token_ids == cold(bundle, tok, prompt), name
    stats = cache.stats()
    assert stats["hits"] == len(cases) and set(stats["hits_by_kind"]) >= {"system", "message", "prompt", "generation"}
    assert 0 < stats["token_hit_rate"] < 1


def test_hits_in_a_batch_equal_cold(tiny):
    bundle, tok = tiny
    cache = _cache(bundle)
    marks = [(len(SYSTEM), "system"), (len(SYSTEM) + len(HISTORY), "message")]
    first = SYSTEM + HISTORY + U1
    run(bundle, tok, [(0, first, SamplingOptions(max_tokens=6), marks)], cache=cache)
    prompts = [
        SYSTEM + U2,  # system hit
        SYSTEM + HISTORY + U3,  # message hit
        first + U2,  # prompt-end hit
        first,  # whole prompt
        _tokens(30, 9),  # miss
        SYSTEM + _tokens(40, 10),  # system hit, a longer suffix over several chunks
    ]
    max_tokens = [9, 12, 7, 10, 8, 11]
    arrivals = [0, 0, 1, 3, 3, 6]  # rows join a running batch at different steps
    jobs = [(a, p, SamplingOptions(max_tokens=m), marks) for a, p, m in zip(arrivals, prompts, max_tokens)]
    outs, sched = run(bundle, tok, jobs, cache=cache, max_num_seqs=3)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert outs[i].token_ids == cold(bundle, tok, p, m), f"request {i}"
    assert [o.cached_tokens > 0 for o in outs] == [True, True, True, True, False, True]
    assert max(sched.stats()["batch_size_histogram"]) == 3


def test_requests_arriving_together_prefill_a_shared_prefix_once(tiny):
    bundle, tok = tiny
    cache = _cache(bundle)
    marks = [(len(SYSTEM), "system")]
    prompts = [SYSTEM + U1, SYSTEM + U2, SYSTEM + U3]
    jobs = [(0, p, SamplingOptions(max_tokens=5), marks) for p in prompts]
    outs, sched = run(bundle, tok, jobs, cache=cache)
    assert [o.cached_tokens for o in outs] == [0, len(SYSTEM), len(SYSTEM)]
    assert sched.prompt_tokens == sum(len(p) - 1 for p in prompts) - 2 * len(SYSTEM)
    for o, p in zip(outs, prompts):
        assert o.token_ids == cold(bundle, tok, p, 5)


def test_sampled_requests_with_a_hit_reproduce_with_a_seed(tiny):
    bundle, tok = tiny
    cache = _cache(bundle)
    marks = [(len(SYSTEM), "system")]
    opts = SamplingOptions(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    run(bundle, tok, [(0, SYSTEM + U1, SamplingOptions(max_tokens=3), marks)], cache=cache)
    (hit,), _ = run(bundle, tok, [(0, SYSTEM + U2, opts)], cache=cache)
    (ref,), _ = run(bundle, tok, [(0, SYSTEM + U2, opts)])
    assert hit.cached_tokens == len(SYSTEM) and hit.token_ids == ref.token_ids


class _Oracle:
    """Draft hook: proposes the true greedy continuation (so drafts are accepted) and records what
    the head itself proposed at each position, which depends on its restored cache."""

    def __init__(self, truths: list[list[int]]):
        self.truths = truths
        self.proposals: dict[tuple[int, int], list[int]] = {}

    def __call__(self, histories, drafts):
        out = []
        for h, d in zip(histories, drafts):
            if d is None:
                out.append(None)
                continue
            i = max((j for j, t in enumerate(self.truths) if t[: len(h)] == h), key=lambda j: len(self.truths[j]))
            self.proposals[(i, len(h))] = list(d)
            truth = self.truths[i][len(h) : len(h) + len(d)]
            out.append(truth + [0] * (len(d) - len(truth)))
        return out


def test_mtp_continues_right_after_a_hit(tiny):
    bundle, tok = tiny
    n = 12
    marks = [(len(SYSTEM), "system"), (len(SYSTEM) + len(HISTORY), "message")]
    first = SYSTEM + HISTORY + U1
    prompts = [SYSTEM + U2, SYSTEM + HISTORY + U3, first + U2, first, first + U3[:1]]
    plain = [cold(bundle, tok, p, n) for p in prompts]
    truths = [p + t for p, t in zip(prompts, [cold(bundle, tok, p, n + 3) for p in prompts])]

    def mtp(oracle):
        return hooked_decode(bundle.mtp, oracle, k=2, adaptive=False)

    cold_oracle = _Oracle(truths)
    for i, p in enumerate(prompts):  # alone, no cache: the reference drafts
        (out,), _ = run(bundle, tok, [(0, p, SamplingOptions(max_tokens=n))], decode=mtp(cold_oracle))
        assert out.token_ids == plain[i]

    decode = mtp(_Oracle(truths))
    cache = _cache(bundle, decode)
    run(bundle, tok, [(0, first, SamplingOptions(max_tokens=4), marks)], cache=cache, decode=decode)
    hot_oracle = _Oracle(truths)
    decode.proposer.hook = hot_oracle
    jobs = [(i, p, SamplingOptions(max_tokens=n)) for i, p in enumerate(prompts)]
    outs, _ = run(bundle, tok, jobs, cache=cache, decode=decode)
    assert all(o.cached_tokens > 0 for o in outs)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.mtp_accepted for o in outs) > 0
    # The head's own proposals after a hit: what it proposes without the cache (up to fp32 noise
    # in ties, none expected at this size).
    shared = set(cold_oracle.proposals) & set(hot_oracle.proposals)
    assert len(shared) >= len(prompts)
    assert {k: hot_oracle.proposals[k] for k in shared} == {k: cold_oracle.proposals[k] for k in shared}


def test_mtp_after_a_hit_on_a_generation_snapshot(tiny):
    """End-of-generation snapshots hold no head state: the head skips those positions; the output
    is still the plain output."""
    bundle, tok = tiny
    decode = MTPDecode(bundle.mtp, k=2, adaptive=False)
    cache = _cache(bundle, decode)
    (a,), _ = run(bundle, tok, [(0, SYSTEM + U1, SamplingOptions(max_tokens=8))], cache=cache, decode=decode)
    nxt = SYSTEM + U1 + a.token_ids + U2
    (b,), _ = run(bundle, tok, [(0, nxt, SamplingOptions(max_tokens=10))], cache=cache, decode=decode)
    assert b.cached_tokens == len(SYSTEM + U1) + len(a.token_ids) - 1
    assert cache.stats()["hits_by_kind"] == {"generation": 1}
    assert b.token_ids == cold(bundle, tok, nxt, 10)


def test_snapshots_own_their_arrays(tiny):
    """A snapshot holds copies: freeing the request's caches frees their buffers."""
    bundle, tok = tiny
    cache = _cache(bundle)
    run(bundle, tok, [(0, SYSTEM + HISTORY + U1, SamplingOptions(max_tokens=2), [(len(SYSTEM), "system")])], cache=cache)
    mx.clear_cache()
    held = cache.nbytes
    entries = cache.tree.entries()
    assert held == sum(e.payload.nbytes for e in entries) > 0
    # every stored array is exactly its own size (no 256-token KV reservation, no chunk-wide view)
    for e in entries:
        for a in e.payload.arrays():
            assert a.size * a.itemsize == a.nbytes
    for e in entries:
        kv = [p for p in e.payload.layers if not isinstance(p, list)]
        assert len(kv) == sum(1 for p in e.payload.layers) - sum(1 for p in e.payload.layers if isinstance(p, list))
        assert all(p.end - p.start == (p.keys.shape[2] if p.keys is not None else 0) for p in kv)


def test_abort_mid_prefill_after_a_hit_leaves_the_cache_usable(tiny):
    """A request aborted while prefilling on a restored prefix: nothing pinned, nothing broken; the
    next request hits and matches the cold output."""
    from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
    from vllm_mlx_mtp_routing.text_engine.state import TextRequest

    bundle, tok = tiny
    cache = _cache(bundle)
    marks = [(len(SYSTEM), "system")]
    run(bundle, tok, [(0, SYSTEM + U1, SamplingOptions(max_tokens=2), marks)], cache=cache)
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=2, prefill_step_size=PREFILL, prefix_cache=cache)
    sched.add(TextRequest("a", SYSTEM + _tokens(60, 11), SamplingOptions(max_tokens=5), marks))
    sched.step()  # restores the system prefix, prefills one chunk of the rest
    assert 0 < sched.prefilling[0].prefilled < len(SYSTEM) + 59
    assert sched.abort("a").finish_reason == "abort"
    assert all(e.pins == 0 for e in cache.tree.entries())
    (out,), _ = run(bundle, tok, [(0, SYSTEM + U2, SamplingOptions(max_tokens=8))], cache=cache)
    assert out.cached_tokens == len(SYSTEM) and out.token_ids == cold(bundle, tok, SYSTEM + U2, 8)


def test_a_prefill_aborted_halfway_is_resumed_by_its_retry_and_equals_cold(tiny):
    """A client that hangs up mid-prefill and retries: the retry restores where the aborted prefill stopped (a chunk
    end) and its output equals a cold run's."""
    from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
    from vllm_mlx_mtp_routing.text_engine.state import TextRequest

    bundle, tok = tiny
    cache = _cache(bundle)
    prompt = _tokens(90, 12)
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=2, prefill_step_size=PREFILL, prefix_cache=cache)
    sched.prefill_time_s = (1e-9, 1e-9)  # one chunk a step
    sched.add(TextRequest("a", prompt, SamplingOptions(max_tokens=6)))
    for _ in range(3):
        sched.step()
    stopped = sched.prefilling[0].prefilled
    assert 0 < stopped < len(prompt) - 1
    sched.abort("a")
    assert cache.stats()["snapshots_saved"] == 1
    (out,), _ = run(bundle, tok, [(0, prompt, SamplingOptions(max_tokens=6))], cache=cache)
    assert out.cached_tokens == stopped and out.token_ids == cold(bundle, tok, prompt, 6)
    assert cache.stats()["hits_by_kind"] == {"progress": 1}


def test_a_long_prefill_leaves_progress_snapshots_at_fixed_positions(tiny, monkeypatch):
    from vllm_mlx_mtp_routing.prefix_cache import plan

    monkeypatch.setattr(plan, "PROGRESS_TOKENS", 24)
    bundle, tok = tiny
    cache = _cache(bundle)
    prompt = _tokens(80, 13)
    (first,), _ = run(bundle, tok, [(0, prompt, SamplingOptions(max_tokens=4))], cache=cache)
    kinds = sorted((e.length, e.kind) for e in cache.tree.entries())
    assert kinds[:3] == [(24, "progress"), (48, "progress"), (72, "progress")]
    # another prompt sharing the first 50 tokens resumes at 48, and matches its cold run
    other = prompt[:50] + _tokens(30, 14)
    (out,), _ = run(bundle, tok, [(0, other, SamplingOptions(max_tokens=8))], cache=cache)
    assert out.cached_tokens == 48 and out.token_ids == cold(bundle, tok, other, 8)


def test_a_later_turn_takes_no_message_snapshot_just_past_its_hit(tiny):
    """A later turn whose last message starts a few tokens past its hit is prefilled without a cut there (a request
    resuming at that message resumes at the hit instead); one further on keeps its snapshot. Outputs equal cold."""
    bundle, tok = tiny
    cache = _cache(bundle)
    first = SYSTEM + HISTORY + U1
    run(bundle, tok, [(0, first, SamplingOptions(max_tokens=4))], cache=cache)
    reply = _tokens(5, 11)
    near = len(first) + len(reply)  # the next message's start: 5 tokens past the hit at len(first) - 1
    far_reply = _tokens(40, 12)
    far = len(first) + len(far_reply)
    for prompt, at, kept in [(first + reply + U2, near, False), (first + far_reply + U3, far, True)]:
        (out,), _ = run(bundle, tok, [(0, prompt, SamplingOptions(max_tokens=6), [(at, "message")])], cache=cache)
        assert out.cached_tokens == len(first) - 1
        assert (cache.tree.get(prompt, at) is not None) is kept
        assert out.token_ids == cold(bundle, tok, prompt, 6)


def test_end_of_prompt_and_generation_snapshots_are_taken_once_the_output_is_delivered(tiny):
    """The step that gives a row its first token returns it before the end-of-prompt snapshot is copied, and the step
    that finishes it returns before its end-of-generation snapshot is; the scheduler has work until they are
    (finish_delivered, or its next step), and the next turn hits them."""
    bundle, tok = tiny
    cache = _cache(bundle)
    sched = BatchScheduler(bundle.model, tok, prefill_step_size=PREFILL, prefix_cache=cache)
    prompt = SYSTEM + U1
    sched.add(TextRequest("a", prompt, SamplingOptions(max_tokens=3)))
    outs: list = []
    while not sched.running:
        outs = sched.step()
    assert [len(o.token_ids) for o in outs] == [1]  # its first token, in the step of its join
    assert cache.tree.get(prompt, len(prompt) - 1) is None and sched.has_work()
    sched.finish_delivered()
    assert cache.tree.get(prompt, len(prompt) - 1) is not None
    final = None
    while final is None:
        final = next((o for o in sched.step() if o.finished), None)
    tokens = SYSTEM + U1 + final.token_ids
    assert not sched.running and sched.has_work()
    assert cache.tree.longest(tokens, len(tokens), space=None).length < len(SYSTEM + U1)
    sched.finish_delivered()
    assert not sched.has_work()
    assert cache.tree.longest(tokens, len(tokens), space=None).length >= len(SYSTEM + U1) + 1
    (out,), _ = run(bundle, tok, [(0, tokens + U2, SamplingOptions(max_tokens=5))], cache=cache)
    assert out.cached_tokens >= len(SYSTEM + U1) + 1 and out.token_ids == cold(bundle, tok, tokens + U2, 5)
