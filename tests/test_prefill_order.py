"""Short prompts pass a long one under way (text_engine/prefill_order.py), without a model; and in the scheduler, a
question sent behind a long prompt is answered first, with the outputs each request has alone."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import pytest

from vllm_mlx_mtp_routing.text_engine.prefill_order import LONG_TOKENS, MAX_PASSING, SHORT_TOKENS, prefill_order
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.state import TextRequest


@dataclass
class R:
    to_prefill: int
    prefilled: int = 0


def test_short_prompts_pass_a_long_head_at_most_max_passing_a_step():
    rows = [R(LONG_TOKENS * 3, 100), R(40), R(SHORT_TOKENS + 1), R(10), R(12), R(5)]
    plain = [True] * len(rows)
    order = prefill_order(rows, plain, head_waited=False)
    assert order[:MAX_PASSING] == [1, 3] and sorted(order) == list(range(len(rows)))
    assert order[MAX_PASSING:] == [0, 2, 4, 5]  # the rest in queue order


def test_no_passing_behind_a_short_head_after_a_step_the_head_waited_or_for_an_image():
    long_head = [R(LONG_TOKENS), R(10)]
    assert prefill_order([R(LONG_TOKENS - 1), R(10)], [True, True], False) == [0, 1]
    assert prefill_order(long_head, [True, True], head_waited=True) == [0, 1]  # the head's turn: no starving it
    assert prefill_order(long_head, [True, False], False) == [0, 1]  # an image to encode: its cost is not its tokens
    assert prefill_order([R(LONG_TOKENS), R(300, 300)], [True, True], True) == [1, 0]  # prefilled: it only joins


@pytest.mark.parametrize("short_tokens", [20, 100])  # 100: its prefill takes two of the 64-token steps
def test_a_question_behind_a_long_prompt_is_answered_first_with_its_own_output(tiny, short_tokens):
    bundle, tok = tiny
    long_ids = [int(t) for t in mx.random.randint(10, 3000, (LONG_TOKENS + 300,), key=mx.random.key(11)).tolist()]
    short_ids = [int(t) for t in mx.random.randint(10, 3000, (short_tokens,), key=mx.random.key(12)).tolist()]

    def alone(ids: list[int]) -> list[int]:
        s = BatchScheduler(bundle.model, tok, max_num_seqs=2, prefill_step_size=64)
        s.add(TextRequest("x", ids, SamplingOptions(max_tokens=6)))
        out = []
        while s.has_work():
            out += [t for o in s.step() for t in o.new_token_ids]
        return out

    sched = BatchScheduler(bundle.model, tok, max_num_seqs=2, prefill_step_size=64)  # a chunk of 64 tokens a step
    sched.add(TextRequest("long", long_ids, SamplingOptions(max_tokens=6)))
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {"long": [], "short": []}
    step = 0
    while sched.has_work() or step < 3:
        if step == 2:  # the long prompt is under way
            sched.add(TextRequest("short", short_ids, SamplingOptions(max_tokens=6)))
        for o in sched.step():
            if o.new_token_ids:
                first.setdefault(o.request_id, step)
                tokens[o.request_id] += o.new_token_ids
        step += 1
    assert first["short"] <= 4 < first["long"]  # its prompt went ahead: it did not wait for the long one's chunks
    assert sched.stats()["prompts_passed"] == 1  # one prompt, however many steps it went ahead in
    assert tokens["short"] == alone(short_ids) and tokens["long"] == alone(long_ids)
