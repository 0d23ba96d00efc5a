"""Time-bounded prefill: chunks fixed per prompt, chunks per step by the clock; outputs unchanged."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from vllm_mlx_mtp_routing.text_engine.prefill_budget import MIN_CHUNK, ChunkGrid, PrefillBudget, calibrate
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.state import TextRequest


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
    assert budget.decode_step_s > 0 and budget.per_token_s > 0 and budget.attention_s >= 0
    assert budget.chunk_at(0) == budget.chunk_tokens and budget.chunk_at(10**6) <= budget.chunk_tokens
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
    from vllm_mlx_mtp_routing.plugin_api.errors import FlagError
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


def test_the_attention_probe_reads_a_cache_as_deep_as_asked(tiny_text) -> None:
    import mlx.core as mx

    from vllm_mlx_mtp_routing.model.mlx_lm_internals import KVCache
    from vllm_mlx_mtp_routing.text_engine.prefill_budget import deep_cache

    model, _ = tiny_text
    cache = model.make_cache()
    mx.eval(model(mx.array([[5, 6, 7]]), cache=cache))
    layers = [c for c in cache if isinstance(c, KVCache)]
    deep_cache(layers, 1000)
    assert layers and {c.offset for c in layers} == {1000}
    mx.eval(model(mx.array([[8, 9]]), cache=cache))  # a chunk reads them as a prefilled prompt's
    assert {c.offset for c in layers} == {1002}
    deep_cache(layers, 2000)
    assert {c.offset for c in layers} == {2000} and min(c.keys.shape[2] for c in layers) >= 2000


def _budget(**kw) -> PrefillBudget:
    values = dict(chunk_tokens=256, max_chunk_tokens=2048, ratio=3.0, decode_step_s=0.01, chunk_fixed_s=0.01,
                  per_token_s=1e-4, calibration_s=0.0, attention_s=2e-8, probe_depth=8192)
    return PrefillBudget(**{**values, **kw})


def test_chunks_shrink_with_the_position_within_the_limit() -> None:
    budget = _budget()
    sizes = [budget.chunk_at(p) for p in (0, 1024, 4096, 16384, 65536, 262144)]
    assert sizes[0] == 192 and sizes == sorted(sizes, reverse=True) and sizes[-1] < MIN_CHUNK
    for p, n in zip((0, 1024, 4096, 16384, 65536, 262144), sizes):
        assert n >= 1 and (n < MIN_CHUNK or n % MIN_CHUNK == 0)
        assert budget.chunk_s(n, p) <= budget.chunk_limit_s or n == 1
        step = MIN_CHUNK if n >= MIN_CHUNK else 1
        assert budget.chunk_s(n + step, p) > budget.chunk_limit_s or n == budget.chunk_tokens  # the largest that fits
    # where even a MIN_CHUNK chunk at the start is over the target, no chunk costs more than that one
    slow = _budget(chunk_tokens=MIN_CHUNK, chunk_fixed_s=0.03, per_token_s=0.004, attention_s=6.6e-7)
    assert slow.chunk_limit_s == pytest.approx(slow.chunk_s(MIN_CHUNK, 0))
    assert slow.chunk_at(0) == MIN_CHUNK and 3 <= slow.chunk_at(15000) <= 5  # the CPU of the former BENCHMARKS.md section 7
    assert _budget(attention_s=0.0).chunk_at(10**6) == 256  # not measured: fixed chunks
    assert _budget(ratio=0.0).chunk_at(10**6) == 256


def test_the_chunk_grid_ends_chunks_where_a_prefill_from_the_start_would() -> None:
    budget = _budget(chunk_fixed_s=0.003, attention_s=2e-7)
    grid = ChunkGrid(budget.chunk_at)
    ends, p = [], 0
    while p < 20000:
        p = grid.next_end(p)
        ends.append(p)
    assert all(b - a == budget.chunk_at(a) for a, b in zip([0, *ends], ends))
    assert ends[1] - ends[0] > ends[-1] - ends[-2]
    fresh = ChunkGrid(budget.chunk_at)  # a prefill resumed anywhere (a snapshot) meets the same ends
    for start in (0, 1, 191, 192, 5000, 19999):
        assert fresh.next_end(start) == min(e for e in ends if e > start)
    assert ChunkGrid(lambda p: 64).next_end(130) == 192  # fixed chunks: the multiples of the chunk


def test_chunks_that_shrink_keep_outputs_and_a_snapshot_restore_exact(tiny_text) -> None:
    model, tok = tiny_text
    shrinking = lambda p: max(1, 24 - p // 8)  # noqa: E731 - chunks of 24 tokens down to 1 within 190 positions
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 3000, size=n).tolist() for n in (9, 230, 75)]

    def run(grid: bool, time_s: tuple[float, float] | None):
        sched = BatchScheduler(model, tok, max_num_seqs=4, prefill_step_size=256)
        sched.prefill_chunk = 24
        sched.chunk_grid = ChunkGrid(shrinking) if grid else None
        sched.prefill_time_s = time_s
        sched.add(TextRequest("a", prompts[0], SamplingOptions(max_tokens=12)))
        finals, step, chunks = {}, 0, []
        while sched.has_work():
            if step == 2:
                sched.add(TextRequest("b", prompts[1], SamplingOptions(max_tokens=6)))
                sched.add(TextRequest("c", prompts[2], SamplingOptions(max_tokens=6)))
            before = sched.prompt_tokens
            for out in sched.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
            chunks.append(sched.prompt_tokens - before)
            step += 1
        return finals, chunks

    bounded, chunks = run(True, (1e-9, 1e-9))  # one chunk per step
    assert bounded == run(True, None)[0]  # as many chunks per step as fit: the same outputs
    assert 1 in chunks and 24 in chunks  # the grid's chunks, large at the start and one token deep
    sched = BatchScheduler(model, tok, max_num_seqs=1, prefill_step_size=256)
    sched.chunk_grid = ChunkGrid(shrinking)
    sched.add(TextRequest("b", prompts[1], SamplingOptions(max_tokens=6)))
    alone = [out.token_ids for _ in range(400) if sched.has_work() for out in sched.step() if out.finished]
    assert alone == [bounded["b"]]  # alone, its prefill uninterrupted: the same output


def test_a_prefill_resumed_from_a_snapshot_cuts_at_the_grid_ends(tiny_text) -> None:
    from vllm_mlx_mtp_routing.prefix_cache.cache import PrefixCache

    model, tok = tiny_text
    grid = ChunkGrid(lambda p: max(1, 24 - p // 8))
    cache = PrefixCache(model, 64 << 20)
    prompt = np.random.default_rng(9).integers(10, 3000, size=160).tolist()
    system = 37  # a snapshot position inside a chunk

    def prefill(prompt_ids, marks=()):
        sched = BatchScheduler(model, tok, max_num_seqs=1, prefill_step_size=256, prefix_cache=cache)
        sched.chunk_grid = grid
        cuts, real = [], sched.runner.prefill

        def spy(work):
            cuts.extend((w.start, w.end) for w in work)
            return real(work)

        sched.runner.prefill = spy
        sched.add(TextRequest("r", prompt_ids, SamplingOptions(max_tokens=2), snapshot_at=list(marks)))
        outs = [out for _ in range(400) if sched.has_work() for out in sched.step() if out.finished]
        return outs[0], cuts

    first, cuts = prefill(prompt[:100], [(system, "system")])
    assert first.cached_tokens == 0 and (cuts[0][0], cuts[-1][1]) == (0, 99)
    ends = {grid.next_end(p) for p in range(0, 160)}
    assert all(e in ends or e in (system, 99) for _, e in cuts)  # the grid's ends, and the snapshot's
    again, cuts = prefill(prompt[:40] + prompt[100:150])  # a new turn after the system block
    assert again.cached_tokens == system and cuts[0][0] == system
    assert [e for _, e in cuts[:-1]] == [e for e in sorted(ends) if system < e < 89]  # as if prefilled from 0


def test_mtp_decoding_with_chunks_that_shrink_is_the_same_batched_and_alone(tiny) -> None:
    from scheduling import run_schedule
    from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode

    bundle, tok = tiny
    grid = ChunkGrid(lambda p: max(1, 24 - p // 8))
    rng = np.random.default_rng(11)
    jobs = [(0, rng.integers(10, 3000, size=7).tolist(), SamplingOptions(max_tokens=16)),
            (2, rng.integers(10, 3000, size=210).tolist(), SamplingOptions(max_tokens=8)),
            (3, rng.integers(10, 3000, size=60).tolist(), SamplingOptions(max_tokens=8))]

    def run(js):
        finals, _ = run_schedule(bundle.model, tok, js, max_num_seqs=4, prefill_step_size=256, chunk_grid=grid,
                                 decode=MTPDecode(bundle.mtp, k=2, adaptive=False))
        return [finals[i].token_ids for i in range(len(js))]

    batched = run(jobs)
    assert batched == [run([(0, *job[1:])])[0] for job in jobs]


def test_a_prompt_longer_than_a_chunk_joins_the_step_after_its_last_chunk_while_rows_decode(tiny_text) -> None:
    """Its join (KV copy, first decode, perhaps its leaving) is not stacked on a step that already ran prefill while
    streams wait on it; a one-chunk prompt, or a long one with nothing decoding, joins in the step of its last chunk."""
    model, tok = tiny_text
    rng = np.random.default_rng(5)

    def join_steps(prompt_len: int, beside: bool) -> tuple[int, int]:
        """(the step of its last chunk, the step it joined in)."""
        sched = BatchScheduler(model, tok, max_num_seqs=4, prefill_step_size=256)
        sched.prefill_chunk = 16
        if beside:
            sched.add(TextRequest("s", rng.integers(10, 3000, size=5).tolist(), SamplingOptions(max_tokens=100)))
            sched.step()
        sched.add(TextRequest("p", rng.integers(10, 3000, size=prompt_len).tolist(), SamplingOptions(max_tokens=3)))
        last_chunk = joined = None
        for step in range(100):
            before = sched.prompt_tokens
            sched.step()
            if sched.prompt_tokens > before:
                last_chunk = step
            if joined is None and any(r.rid == "p" for r in sched.running):
                joined = step
                break
        return last_chunk, joined

    chunked = join_steps(60, beside=True)
    assert chunked[1] == chunked[0] + 1  # four chunks (one step here: no time limit), then the join starts the next step
    assert join_steps(12, beside=True) == (0, 0)  # one chunk: prefilled and joined in one step
    alone = join_steps(60, beside=False)
    assert alone[0] == alone[1]  # nothing decoding: no stream to spare


def test_the_exactness_probe_tells_a_device_whose_chunks_change_the_numerics(tiny_text) -> None:
    import mlx.core as mx

    from vllm_mlx_mtp_routing.text_engine.prefill_budget import chunking_is_exact

    model, _ = tiny_text
    ids = mx.random.randint(0, 1000, (1, 80), key=mx.random.key(0))
    assert chunking_is_exact(model, ids)  # MLX's CPU backend: a prompt's state does not depend on its chunks

    class ChunkSensitive:  # a state that depends on the chunk sizes, as a GPU's shape-picked kernels may make it
        def make_cache(self):
            return model.make_cache()

        def __call__(self, tokens, cache):
            out = model(tokens, cache=cache)
            cache[0][1] = cache[0][1] * (1 + 1e-3 * tokens.shape[1] ** 2)
            return out

    assert not chunking_is_exact(ChunkSensitive(), ids)


def test_where_chunking_is_exact_a_lone_prompt_takes_large_chunks_and_outputs_do_not_change(tiny_text) -> None:
    model, tok = tiny_text
    grid = ChunkGrid(lambda p: max(1, 24 - p // 8))
    rng = np.random.default_rng(21)
    long_prompt = rng.integers(10, 3000, size=230).tolist()

    def run(*, idle: bool, beside: bool):
        sched = BatchScheduler(model, tok, max_num_seqs=4, prefill_step_size=256)
        sched.chunk_grid = grid
        sched.idle_chunk = (lambda p, rate: 100) if idle else None
        if beside:  # a stream decodes while the long prompt prefills
            sched.add(TextRequest("s", rng.integers(10, 3000, size=5).tolist(), SamplingOptions(max_tokens=40)))
            sched.step()
        chunks, real = [], sched.runner.prefill

        def spy(work):
            chunks.extend(w.end - w.start for w in work if w.row.rid == "p")
            return real(work)

        sched.runner.prefill = spy
        sched.add(TextRequest("p", long_prompt, SamplingOptions(max_tokens=6)))
        finals = {out.request_id: out.token_ids for _ in range(500) if sched.has_work() for out in sched.step()
                  if out.finished}
        return finals["p"], chunks

    lone, lone_chunks = run(idle=True, beside=False)
    batched, batched_chunks = run(idle=True, beside=True)
    reference, grid_chunks = run(idle=False, beside=False)
    assert lone_chunks == [100, 100, 29]  # nothing decodes: the large chunks
    assert max(batched_chunks) <= 24 and len(batched_chunks) > len(lone_chunks)  # the grid while the stream decodes
    assert lone == batched == reference and grid_chunks != lone_chunks


def test_a_lone_prompts_chunk_fills_the_idle_time_within_the_step_size() -> None:
    from vllm_mlx_mtp_routing.text_engine.prefill_budget import IDLE_CHUNK_S

    budget = _budget(chunk_exact=True)
    for p in (0, 1024, 16384, 262144):
        n = budget.idle_chunk_at(p)
        assert budget.chunk_at(p) <= n <= budget.max_chunk_tokens
        assert budget.chunk_s(n, p) <= IDLE_CHUNK_S or n == budget.chunk_at(p)
        assert n == budget.max_chunk_tokens or budget.chunk_s(n + MIN_CHUNK, p) > IDLE_CHUNK_S
    assert budget.idle_chunk_at(0) == 2048 and budget.idle_chunk_at(262144) < 2048
    # from the last chunk's measured time: about IDLE_CHUNK_S of it, within the same bounds
    assert budget.idle_chunk_at(262144, IDLE_CHUNK_S / 500) == 496
    assert budget.idle_chunk_at(0, IDLE_CHUNK_S / 10**6) == 2048
    assert budget.idle_chunk_at(262144, 100.0) == budget.chunk_at(262144)
    assert budget.stats()["idle_chunk_at"] is not None and _budget().stats()["idle_chunk_at"] is None


def test_a_model_whose_forward_fails_starts_with_one_line_and_the_fixed_chunk(tmp_path, caplog) -> None:
    """A forward the device cannot run (as a bf16 MoE on MLX's CPU GatherMM was): one error line naming the cause, the
    --prefill-step-size chunk, nothing stored."""
    from vllm_mlx_mtp_routing.text_engine import calibration_file

    class Refusing:
        def make_cache(self) -> list:
            return []

        def __call__(self, tokens, cache=None):
            raise RuntimeError("[GatherMM::eval] Currently only supports float32.")

    path = tmp_path / "calibration.json"
    with caplog.at_level(logging.INFO, logger="vllm_mlx_mtp_routing"):
        budget = calibration_file.calibrated(Refusing(), max_chunk=512, ratio=3.0, vocab_size=100, path=path, weights="w")
    assert (budget.chunk_tokens, budget.bounded) == (512, False)
    lines = [r for r in caplog.records if "forward fails" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR and not lines[0].exc_info
    assert "RuntimeError: [GatherMM::eval] Currently only supports float32." in lines[0].getMessage()
    assert not path.exists()
