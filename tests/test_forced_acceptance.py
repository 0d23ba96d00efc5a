"""testing.forced_acceptance: the engine's MTP decoding with acceptance as a controlled input (the
realistic-shape GPU benchmark's driver), on the fp32 tiny model through the real scheduler."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling import run_schedule
from support.forced_acceptance import ForcedAcceptanceDecode
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.step_plan import DecodeResult

LENGTHS = [5, 17, 9]
MAX_TOKENS = 12


def _run(bundle, tok, decode=None):
    rng = np.random.default_rng(0)
    jobs = [(0, rng.integers(10, 3000, size=n).tolist(), SamplingOptions(max_tokens=MAX_TOKENS)) for n in LENGTHS]
    finals, _ = run_schedule(bundle.model, tok, jobs, max_num_seqs=4, prefill_step_size=16, decode=decode)
    return [finals[i].token_ids for i in range(len(jobs))]


class Logged(ForcedAcceptanceDecode):
    """Keeps each verify's per-row tokens, drafted and accepted counts."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []
        forced = self.accept

        def accept(logits, drafts, qs, drafting, samplers, k):
            tokens, accepted = forced(logits, drafts, qs, drafting, samplers, k)
            self.log.append(DecodeResult(tokens, [k if d else 0 for d in drafting], accepted))
            return tokens, accepted

        self.accept = accept


def test_rejecting_every_draft_is_plain_greedy(tiny):
    """a = 0: every verify disagrees with its draft, so each row emits the backbone's own token
    after a rollback of the draft: exactly plain decoding, through the real verify and rollback."""
    bundle, tok = tiny
    decode = ForcedAcceptanceDecode(bundle.mtp, 0.0, k=1, adaptive=False)
    assert _run(bundle, tok, decode) == _run(bundle, tok)
    s = decode.stats()
    assert s["drafted"] > 0 and s["accepted"] == 0


@pytest.mark.parametrize("k", [1, 2])
def test_accepting_every_draft_emits_k_plus_one(tiny, k):
    bundle, tok = tiny
    decode = Logged(bundle.mtp, 1.0, k=k, adaptive=False)
    outs = _run(bundle, tok, decode)
    assert all(len(o) == MAX_TOKENS for o in outs)
    s = decode.stats()
    assert s["drafted"] > 0 and s["accepted"] == s["drafted"]
    # a drafting row emits its k drafts and the bonus token (the scheduler cuts at max_tokens later)
    assert all(len(t) == k + 1 for res in decode.log for t, d in zip(res.tokens, res.drafted) if d)


def test_acceptance_is_the_forced_rate_per_row_and_all_or_nothing(tiny):
    bundle, tok = tiny
    per_row = ForcedAcceptanceDecode(bundle.mtp, 0.5, k=1, adaptive=False, seed=1)
    batchwide = Logged(bundle.mtp, 0.5, k=1, adaptive=False, per_row_acceptance=False, seed=1)
    _run(bundle, tok, per_row)
    _run(bundle, tok, batchwide)
    rate = per_row.stats()["acceptance_rate"]
    assert 0.3 < rate < 0.7  # ~24 drafting row-steps at a = 0.5
    # all-or-nothing: every drafting row of a step keeps the same count, so fewer are kept
    for res in batchwide.log:
        assert len({a for a, d in zip(res.accepted, res.drafted) if d}) <= 1
    assert batchwide.stats()["acceptance_rate"] < rate


def test_acceptance_out_of_range_is_refused(tiny):
    bundle, _ = tiny
    with pytest.raises(ValueError, match="acceptance"):
        ForcedAcceptanceDecode(bundle.mtp, 1.5)
