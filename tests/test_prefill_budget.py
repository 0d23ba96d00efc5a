"""Time-bounded prefill: chunks fixed per prompt, chunks per step by the clock; outputs unchanged."""

from __future__ import annotations

import json
import logging

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


def test_a_stored_calibration_is_reused_only_for_the_same_weights_device_and_flags(tiny_text, tmp_path, caplog, monkeypatch) -> None:
    from vllm_mlx_mtp_routing.text_engine import calibration_file as cf

    model, _ = tiny_text
    path = tmp_path / "calibration.json"

    def get(weights="w", max_chunk=2048, **kw):
        return cf.calibrated(model, max_chunk=max_chunk, ratio=3.0, vocab_size=1000, path=path, weights=weights, **kw)

    first = get()
    assert first.stored_at is None and len(json.loads(path.read_text())) == 1  # measured, then stored
    caplog.set_level(logging.INFO, logger=cf.__name__)
    again = get()
    assert again.stored_at is not None and again.chunk_tokens == first.chunk_tokens
    assert again.stats() == {**first.stats(), "stored_at": again.stored_at}  # the same numbers, not a new measurement
    assert "as measured on" in caplog.text and "--prefill-recalibrate" in caplog.text
    assert cf.calibrated(model, max_chunk=2048, ratio=3.0, vocab_size=1000, path=path).stored_at is None  # real weights
    assert get(weights="other").stored_at is None  # other weights
    assert get(max_chunk=1024).stored_at is None  # other flags
    device = cf.device_identity()
    monkeypatch.setattr(cf, "device_identity", lambda: {**device, "device_info": {"device_name": "another"}})
    assert get().stored_at is None  # another device: measured, kept beside the first
    monkeypatch.undo()
    entries = json.loads(path.read_text())
    assert len(entries) == 5
    remeasured = get(remeasure=True)
    assert remeasured.stored_at is None and len(json.loads(path.read_text())) == 5  # replaced, not added
    assert get().stored_at is not None
    assert cf.calibrated(model, max_chunk=2048, ratio=3.0, vocab_size=1000, path=None, weights="w").stored_at is None
    assert cf.calibrated(model, max_chunk=2048, ratio=0, vocab_size=1000, path=path, weights="w").chunk_tokens == 2048


def test_an_unusable_calibration_file_means_measuring_and_the_file_stays_small(tiny_text, tmp_path, caplog, monkeypatch) -> None:
    from vllm_mlx_mtp_routing.errors import FlagError
    from vllm_mlx_mtp_routing.text_engine import calibration_file as cf

    model, _ = tiny_text
    caplog.set_level(logging.WARNING, logger=cf.__name__)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert cf.calibrated(model, max_chunk=256, ratio=3.0, vocab_size=1000, path=broken, weights="w").stored_at is None
    assert "unreadable" in caplog.text and len(json.loads(broken.read_text())) == 1  # rewritten whole
    (tmp_path / "a-file").write_text("")
    budget = cf.calibrated(model, max_chunk=256, ratio=3.0, vocab_size=1000, path=tmp_path / "a-file" / "c.json", weights="w")
    assert budget.chunk_tokens >= MIN_CHUNK and "measured at every start" in caplog.text
    assert cf.from_flag("none") is None and cf.from_flag(str(broken)) == broken
    monkeypatch.setattr(cf, "KEEP", 2)  # the newest entries are kept
    for weights in ("x", "y"):
        cf.calibrated(model, max_chunk=256, ratio=3.0, vocab_size=1000, path=broken, weights=weights)
    assert len(json.loads(broken.read_text())) == 2
    with pytest.raises(FlagError, match="--prefill-calibration-file"):
        cf.from_flag(str(tmp_path / "a-file" / "c.json"))
