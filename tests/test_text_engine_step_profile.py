"""The slowest recent steps and where their time went (``text_engine.slowest_steps``)."""

from __future__ import annotations

import time

from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.state import TextRequest
from vllm_mlx_mtp_routing.text_engine.step_profile import StepProfile


def test_a_long_prompt_beside_a_decoding_row_shows_in_the_slowest_steps_parts(tiny_text):
    model, tok = tiny_text
    sched = BatchScheduler(model, tok, max_num_seqs=4, prefill_step_size=16)
    sched.add(TextRequest("short", tok.encode("def f(x):"), SamplingOptions(max_tokens=40)))
    while not sched.running:
        sched.step()
    long_prompt = tok.encode("import os\n" * 30)
    sched.add(TextRequest("long", long_prompt, SamplingOptions(max_tokens=1)))
    while sched.has_work():
        sched.step()
    slowest = sched.stats()["slowest_steps"]
    assert 1 <= len(slowest) <= 5
    assert [s["gap_s"] for s in slowest] == sorted((s["gap_s"] for s in slowest), reverse=True)
    steps = {s["step"] for s in slowest}
    assert len(steps) == len(slowest) < sched.steps
    for s in slowest:
        # the parts are inside the step: nothing counted twice, nothing from outside it
        assert s["prefill_s"] + s["join_s"] + s["decode_s"] <= s["total_s"] + 1e-3
        assert abs(s["gap_s"] - s["total_s"] - s["since_previous_s"]) < 1e-3
        assert s["longest_chunk_s"] <= s["prefill_s"] + 1e-6
        assert s["prefill_tokens"] <= 16 * max(s["chunks"], 1)
    # every one of the long prompt's tokens but the last was prefilled in some step, in 16-token chunks
    assert sched.prompt_tokens >= len(long_prompt) - 1


def test_the_profile_keeps_a_window_and_reports_the_slowest_first():
    profile = StepProfile(window=3, top=2)
    for step, (pause, between) in enumerate([(0.09, 0.0), (0.0, 0.0), (0.06, 0.0), (0.0, 0.15), (0.01, 0.0)]):  # apart under load too
        time.sleep(between)  # the event loop held between steps
        record = profile.begin(step)
        record.chunk(8, pause)
        time.sleep(pause)
        profile.end(streams_waiting=True)
    # steps 0 and 1 left the 3-step window; of steps 2-4 the two longest gaps, longest first: step 3's
    # own work was nothing, but its stream waited for the loop
    slowest = profile.slowest()
    assert [s["step"] for s in slowest] == [3, 2]
    assert slowest[0]["since_previous_s"] >= 0.15 > slowest[0]["total_s"]


def test_waiting_for_work_after_the_last_stream_ended_is_nobodys_gap():
    profile = StepProfile()
    profile.begin(0)
    profile.end(streams_waiting=False)  # the step finished the last decoding row
    time.sleep(0.03)  # the engine idles until a request arrives
    profile.begin(1)
    profile.end(streams_waiting=True)
    assert [s["since_previous_s"] for s in profile.slowest() if s["step"] == 1] == [0.0]


def test_a_collection_during_a_step_or_before_it_is_counted_as_the_garbage_collectors(gc_heap_unfrozen):
    import gc

    junk = [[i] for i in range(200_000)]  # containers for the collector to walk
    profile = StepProfile()
    profile.begin(0)
    profile.end(streams_waiting=True)
    gc.collect()  # between steps: the event loop's share
    record = profile.begin(1)
    gc.collect()
    profile.end(streams_waiting=True)
    del junk
    step = next(s for s in profile.slowest() if s["step"] == 1)
    assert 0 < step["gc_s"] <= step["total_s"]
    assert 0 < step["gc_before_s"] <= step["since_previous_s"]
    assert round(record.gc_s, 4) == step["gc_s"]


def test_freezing_the_start_up_heap_takes_it_out_of_later_scans(caplog, gc_heap_unfrozen):
    import gc
    import logging

    from vllm_mlx_mtp_routing import gc_pauses

    keep = [[i] for i in range(100_000)]  # alive for the server's life, as a loaded model's objects are
    try:
        with caplog.at_level(logging.INFO, logger="vllm_mlx_mtp_routing.gc_pauses"):
            gc_pauses.freeze_startup_heap()
        assert gc.get_freeze_count() >= len(keep)
        assert "start-up objects frozen out of the garbage collector's scans" in caplog.text
        before = gc_pauses.stats()["collections"]
        gc.collect()
        assert gc_pauses.stats()["collections"] == before + 1 and gc_pauses.stats()["frozen_objects"] >= len(keep)
    finally:
        gc.unfreeze()
