"""n rows of one request prefill once (OpenAI ``n``): each row's output equals the request alone
with that row's seed, the prompt is prefilled once, and rows arriving late or a leader leaving early
change nothing but the work (fp32 tiny Qwen3.5, with and without MTP)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.shared_prefill import SharedPrefill
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import TextRequest

PREFILL = 16
PROMPT = np.random.default_rng(7).integers(10, 3000, size=37).tolist()


def _opts(seed: int | None, temperature: float = 0.8) -> SamplingOptions:
    return SamplingOptions(max_tokens=10, temperature=temperature, seed=seed)


def _scheduler(bundle, tok, mtp: bool) -> BatchScheduler:
    decode = MTPDecode(bundle.mtp, k=2, adaptive=False) if mtp else None
    return BatchScheduler(bundle.model, tok, max_num_seqs=8, prefill_step_size=PREFILL, decode=decode)


def _run(sched: BatchScheduler, arrivals: dict[int, list[TextRequest]], abort_at: dict[int, str] | None = None) -> dict[str, list[int]]:
    finals, step = {}, 0
    while arrivals or sched.has_work():
        for req in arrivals.pop(step, []):
            sched.add(req)
        if abort_at and step in abort_at:
            sched.abort(abort_at[step])
        for out in sched.step():
            if out.finished and out.finish_reason != "abort":
                assert out.finish_reason == "length", out.error
                finals[out.request_id] = out.token_ids
        step += 1
    return finals


def _alone(bundle, tok, opts: SamplingOptions, mtp: bool) -> list[int]:
    return _run(_scheduler(bundle, tok, mtp), {0: [TextRequest("a", PROMPT, opts)]})["a"]


@pytest.mark.parametrize("mtp", [False, True])
def test_rows_equal_alone_and_prefill_once(tiny, mtp):
    bundle, tok = tiny
    seeds = [11, 12, 13]
    alone = [_alone(bundle, tok, _opts(s), mtp) for s in seeds]
    assert len({tuple(a) for a in alone}) == 3  # the seeds give different completions
    share = SharedPrefill(3)
    sched = _scheduler(bundle, tok, mtp)
    out = _run(sched, {0: [TextRequest(str(i), PROMPT, _opts(s), share=share) for i, s in enumerate(seeds)]})
    assert [out[str(i)] for i in range(3)] == alone
    assert sched.prompt_tokens == len(PROMPT) - 1
    assert sched.stats()["shared_prefill_rows"] == 2
    assert share.snapshot is None  # dropped once every row joined


def test_late_rows_and_a_leader_that_leaves(tiny):
    bundle, tok = tiny
    greedy = _alone(bundle, tok, _opts(None, 0.0), False)
    share = SharedPrefill(4)
    sched = _scheduler(bundle, tok, False)
    reqs = [TextRequest(str(i), PROMPT, _opts(None, 0.0), share=share) for i in range(4)]
    # row 0 leads and is aborted mid-prefill (the prompt takes 3 chunks): row 1 takes over;
    # row 3 arrives after row 1 has joined and starts from the kept state.
    out = _run(sched, {0: reqs[:3], 6: reqs[3:]}, abort_at={1: "0"})
    assert out == {"1": greedy, "2": greedy, "3": greedy}
    assert sched.prompt_tokens < 2 * (len(PROMPT) - 1)  # row 0's chunk, then row 1's whole prompt, once
    assert sched.stats()["shared_prefill_rows"] == 2
    assert share.snapshot is None and not sched.has_work()


def test_a_different_prompt_prefills_alone(tiny):
    bundle, tok = tiny
    share = SharedPrefill(2)
    other = PROMPT[:-3] + [5, 6, 7]
    sched = _scheduler(bundle, tok, False)
    out = _run(sched, {0: [TextRequest("a", PROMPT, _opts(None, 0.0), share=share),
                           TextRequest("b", other, _opts(None, 0.0), share=share)]})
    assert out["b"] == _run(_scheduler(bundle, tok, False), {0: [TextRequest("x", other, _opts(None, 0.0))]})["x"]
    assert sched.prompt_tokens == 2 * (len(PROMPT) - 1)


def test_rows_past_the_n_of_a_request_of_several_equal_prompts_never_wait(tiny):
    """A completion of prompts [P, P] with n=2: each copy runs its prompts one after another, four rows on one
    SharedPrefill(2). The later rows came after the sharing was over and waited for a leader gone long ago."""
    bundle, tok = tiny
    greedy = _alone(bundle, tok, _opts(None, 0.0), False)
    share = SharedPrefill(2)
    sched = _scheduler(bundle, tok, False)
    reqs = [TextRequest(str(i), PROMPT, _opts(None, 0.0), share=share) for i in range(4)]
    arrivals, finals = {0: reqs[:2], 20: reqs[2:3], 24: reqs[3:]}, {}
    for step in range(200):
        for req in arrivals.pop(step, []):
            sched.add(req)
        finals |= {out.request_id: out.token_ids for out in sched.step() if out.finished}
        if not arrivals and not sched.has_work():
            break
    assert finals == {str(i): greedy for i in range(4)}
