"""Time-bounded prefill: chunks fixed per prompt, chunks per step by the clock; outputs unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_mlx_mtp_routing.text_engine import BatchScheduler, SamplingOptions, TextRequest
from vllm_mlx_mtp_routing.text_engine.prefill_budget import MIN_CHUNK, calibrate


def _run(model, tok, *, time_s, step_size=256):
    sched = BatchScheduler(model, tok, max_num_seqs=4, prefill_step_size=step_size)
    sched.prefill_chunk = 16
    sched.prefill_time_s = time_s
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 3000, size=n).tolist() for n in (9, 120, 75)]
    sched.add(TextRequest("a", prompts[0], SamplingOptions(max_tokens=20)))
    finals, per_step, step = {}, [], 0
    while sched.has_work():
        if step == 2:  # the long prompts arrive while "a" decodes
            sched.add(TextRequest("b", prompts[1], SamplingOptions(max_tokens=6)))
            sched.add(TextRequest("c", prompts[2], SamplingOptions(max_tokens=6)))
        before = sched.prompt_tokens
        decoding = bool(sched.running)
        for out in sched.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
        per_step.append((decoding, sched.prompt_tokens - before))
        step += 1
    return finals, per_step


def test_chunks_per_step_follow_the_clock_and_outputs_do_not(tiny_text) -> None:
    model, tok = tiny_text
    bounded, steps_bounded = _run(model, tok, time_s=(1e-9, 1e-9))  # one chunk per step, always
    free, steps_free = _run(model, tok, time_s=None)  # tokens only: up to 256 per step
    assert bounded == free
    assert max(n for decoding, n in steps_bounded if decoding) <= 16
    assert max(n for _, n in steps_free) > 16


def test_calibration_picks_a_chunk_within_the_bounds(tiny_text) -> None:
    model, _ = tiny_text
    budget = calibrate(model, max_chunk=2048, ratio=3.0, vocab_size=1000)
    assert MIN_CHUNK <= budget.chunk_tokens <= 2048 and budget.chunk_tokens % MIN_CHUNK == 0
    assert budget.decode_step_s > 0 and budget.per_token_s > 0
    assert budget.probe_tokens <= 2048 and budget.probe_tokens >= 24
    assert calibrate(model, max_chunk=2048, ratio=0, vocab_size=1000).chunk_tokens == 2048  # 0: off
    assert calibrate(model, max_chunk=64, ratio=3.0, vocab_size=1000).probe_tokens <= 64  # the probe never passes the cap
    sched = BatchScheduler(model, tiny_text[1], max_num_seqs=2, prefill_step_size=2048)
    budget.apply(sched)
    assert sched.prefill_chunk == budget.chunk_tokens and sched.prefill_time_s[0] == pytest.approx(3.0)
