"""The text engine is exact under batching: a request's tokens never depend on the others.

fp32 tiny Qwen3.5 (hybrid gated-delta + attention). Greedy: alone == mlx-lm single-sequence
``stream_generate``; batched (unequal prompts, staggered arrivals, max_num_seqs < requests, prompts
spanning several prefill chunks) == alone. Seeded sampling: batched == alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.generate import stream_generate

import scheduling
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions

PREFILL = 16  # small, so prompts span several chunks and chunk boundaries are exercised


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 3000, size=n).tolist() for n in lengths]


def run_schedule(model, tokenizer, jobs, *, max_num_seqs, prefill_step_size=PREFILL):
    return scheduling.run_schedule(model, tokenizer, jobs, max_num_seqs=max_num_seqs, prefill_step_size=prefill_step_size)


def alone(model, tokenizer, prompt, options):
    finals, _ = run_schedule(model, tokenizer, [(0, prompt, options)], max_num_seqs=1)
    return finals[0]


@pytest.mark.parametrize("length", [1, 2, 5, 16, 17, 33, 70])
def test_alone_matches_mlx_lm_stream_generate(tiny_text, length):
    model, tok = tiny_text
    prompt = _prompts([length], seed=length)[0]
    n = 10
    ref = [
        r.token
        for r in stream_generate(model, tok, prompt, max_tokens=n, prefill_step_size=PREFILL)
    ]
    out = alone(model, tok, prompt, SamplingOptions(max_tokens=n))
    assert out.token_ids[: len(ref)] == ref
    if len(ref) == n:  # stream_generate stopped at no EOS
        assert out.token_ids == ref and out.finish_reason == "length"


def test_batched_matches_alone_greedy(tiny_text):
    model, tok = tiny_text
    lengths = [70, 1, 3, 16, 45, 17, 8, 33]  # 70 and 45 span 4-5 chunks of 16
    prompts = _prompts(lengths, seed=1)
    arrivals = [0, 0, 0, 1, 2, 4, 7, 11]
    max_tokens = [12, 9, 14, 6, 10, 13, 8, 11]  # rows leave at different steps
    jobs = [(a, p, SamplingOptions(max_tokens=m)) for a, p, m in zip(arrivals, prompts, max_tokens)]

    finals, sched = run_schedule(model, tok, jobs, max_num_seqs=3)

    for i, (_, p, o) in enumerate(jobs):
        assert finals[i].token_ids == alone(model, tok, p, o).token_ids, f"request {i}"
        assert finals[i].completion_tokens == o.max_tokens
    hist = sched.stats()["batch_size_histogram"]
    assert max(hist) == 3 and sum(hist.values()) > 0  # rows really decoded together


def test_batched_matches_mlx_lm_greedy(tiny_text):
    """The same schedule compared straight with mlx-lm, not only with the engine alone."""
    model, tok = tiny_text
    prompts = _prompts([40, 2, 21, 9, 64, 5], seed=2)
    jobs = [(i // 2, p, SamplingOptions(max_tokens=8)) for i, p in enumerate(prompts)]
    finals, _ = run_schedule(model, tok, jobs, max_num_seqs=4)
    for i, p in enumerate(prompts):
        ref = [r.token for r in stream_generate(model, tok, p, max_tokens=8, prefill_step_size=PREFILL)]
        assert finals[i].token_ids[: len(ref)] == ref, f"request {i}"


def test_seeded_sampling_same_alone_and_batched(tiny_text):
    model, tok = tiny_text
    prompts = _prompts([12, 30, 3, 50, 7, 21], seed=3)
    opts = [
        SamplingOptions(max_tokens=12, temperature=0.9, seed=7),
        SamplingOptions(max_tokens=12, temperature=1.2, top_p=0.8, seed=11),
        SamplingOptions(max_tokens=12),  # greedy rows mixed in
        SamplingOptions(max_tokens=12, temperature=0.7, top_k=20, seed=3),
        SamplingOptions(max_tokens=12, temperature=1.0, min_p=0.05, seed=5),
        SamplingOptions(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, min_p=0.02, seed=9),
    ]
    jobs = [(i % 3, p, o) for i, (p, o) in enumerate(zip(prompts, opts))]
    finals, _ = run_schedule(model, tok, jobs, max_num_seqs=4)
    for i, (_, p, o) in enumerate(jobs):
        assert finals[i].token_ids == alone(model, tok, p, o).token_ids, f"request {i}"


def test_seed_controls_sampling(tiny_text):
    model, tok = tiny_text
    prompt = _prompts([10], seed=4)[0]

    def sample(seed):
        return alone(model, tok, prompt, SamplingOptions(max_tokens=16, temperature=1.5, seed=seed)).token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    greedy = alone(model, tok, prompt, SamplingOptions(max_tokens=16)).token_ids
    assert sample(1) != greedy


def test_top_k_one_is_greedy(tiny_text):
    model, tok = tiny_text
    prompt = _prompts([10], seed=5)[0]
    greedy = alone(model, tok, prompt, SamplingOptions(max_tokens=10)).token_ids
    top1 = alone(model, tok, prompt, SamplingOptions(max_tokens=10, temperature=2.0, top_k=1, seed=0))
    assert top1.token_ids == greedy
