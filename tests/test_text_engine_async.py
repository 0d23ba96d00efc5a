"""TextEngine: the asyncio step task, streams, abort on disconnect, errors confined to their requests."""

from __future__ import annotations

import asyncio
import contextlib

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx_mtp_routing.text_engine.engine import TextEngine, TextEngineError
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.state import TextRequest

POISON_PREFILL = 3999  # a prompt holding this token fails in prefill
POISON_DECODE = 3998  # a batch feeding this token fails in decode


class FaultyModel:
    """Wraps the real model; raises when it sees a poison token (a stand-in for a failing forward)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None):
        ids = set(np.array(inputs).ravel().tolist())
        if inputs.shape[1] > 1 and POISON_PREFILL in ids:
            raise RuntimeError("prefill blew up")
        if inputs.shape[1] == 1 and POISON_DECODE in ids:
            raise RuntimeError("decode blew up")
        return self._model(inputs, cache=cache)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 3000, size=int(k)).tolist() for k in rng.integers(1, 40, size=n)]


def _alone(model, tok, prompt, opts):
    s = BatchScheduler(model, tok, max_num_seqs=1, prefill_step_size=16)
    s.add(TextRequest("x", prompt, opts))
    last = None
    while s.has_work():
        for o in s.step():
            last = o
    return last


def test_concurrent_generate_matches_alone(tiny_text):
    model, tok = tiny_text
    prompts = _prompts(6)
    opts = SamplingOptions(max_tokens=8)

    async def main():
        engine = TextEngine(model, tok, max_num_seqs=4, prefill_step_size=16)
        await engine.start()
        ticks = 0
        stop_ticking = asyncio.Event()

        async def ticker():  # another task on the same loop must get turns between steps
            nonlocal ticks
            while not stop_ticking.is_set():
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        finals = await asyncio.gather(*(engine.generate(p, opts) for p in prompts))
        stop_ticking.set()
        await t
        stats = engine.stats()
        await engine.stop()
        return finals, ticks, stats

    finals, ticks, stats = asyncio.run(main())
    for p, f in zip(prompts, finals):
        assert f.finished and f.token_ids == _alone(model, tok, p, opts).token_ids
    assert ticks > stats["steps"]
    assert stats["running"] == stats["waiting"] == 0 and stats["tokens_generated"] == 48
    assert max(stats["batch_size_histogram"]) > 1


def test_stream_and_disconnect_aborts(tiny_text):
    model, tok = tiny_text

    async def main():
        engine = TextEngine(model, tok, max_num_seqs=4, prefill_step_size=16)
        await engine.start()
        rid = await engine.add_request([5, 6, 7, 8], SamplingOptions(max_tokens=50), request_id="s")
        assert rid == "s"
        keep = await engine.add_request([9, 10], SamplingOptions(max_tokens=12))
        got = []
        async with contextlib.aclosing(engine.stream("s")) as stream:
            async for out in stream:
                got.append(out)
                if len(got) == 3:
                    break  # the client goes away: the server closes the stream
        assert engine.scheduler._find("s") is None
        outs = [o async for o in engine.stream(keep)]
        assert not await engine.abort("s")
        await engine.stop()
        return got, outs

    got, outs = asyncio.run(main())
    assert [len(o.token_ids) for o in got] == [1, 2, 3]
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 12


def test_explicit_abort_ends_stream(tiny_text):
    model, tok = tiny_text

    async def main():
        engine = TextEngine(model, tok)
        await engine.start()
        rid = await engine.add_request([5, 6, 7], SamplingOptions(max_tokens=200))
        outs = []
        async for out in engine.stream(rid):
            outs.append(out)
            if len(outs) == 2:
                assert await engine.abort(rid)
        await engine.stop()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs) == 3


def test_errors_fail_only_affected_requests(tiny_text):
    model, tok = tiny_text
    faulty = FaultyModel(model)
    good = _prompts(3, seed=5)
    opts = SamplingOptions(max_tokens=6)

    async def main():
        engine = TextEngine(faulty, tok, max_num_seqs=4, prefill_step_size=16)
        await engine.start()
        results = await asyncio.gather(
            engine.generate(good[0], opts),
            engine.generate([11, POISON_PREFILL, 12, 13], opts),
            engine.generate(good[1], opts),
            return_exceptions=True,
        )
        # A decode fault fails the whole running batch (its cache may be half-written) ...
        batch = await asyncio.gather(
            engine.generate([11, 12, POISON_DECODE], opts),
            engine.generate([14, 15, 16], opts),
            return_exceptions=True,
        )
        # ... and the engine keeps serving afterwards.
        after = await engine.generate(good[2], opts)
        stats = engine.stats()
        await engine.stop()
        return results, batch, after, stats

    results, batch, after, stats = asyncio.run(main())
    assert isinstance(results[1], TextEngineError) and "prefill blew up" in str(results[1])
    for p, r in ((good[0], results[0]), (good[1], results[2])):
        assert r.token_ids == _alone(model, tok, p, opts).token_ids
    assert all(isinstance(b, TextEngineError) and "decode blew up" in str(b) for b in batch)
    assert after.token_ids == _alone(model, tok, good[2], opts).token_ids
    assert stats["loop_errors"] == 0 and stats["running"] == 0


def test_engine_requires_start(tiny_text):
    model, tok = tiny_text
    engine = TextEngine(model, tok)
    with pytest.raises(RuntimeError):
        asyncio.run(engine.add_request([1, 2], SamplingOptions()))


def test_accepts_mlx_lm_tokenizer_wrapper(tiny_text):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    model, tok = tiny_text
    wrapped = TokenizerWrapper(tok)
    prompt = tok.encode("import os\n")
    a = _alone(model, wrapped, prompt, SamplingOptions(max_tokens=10))
    b = _alone(model, tok, prompt, SamplingOptions(max_tokens=10))
    assert a.token_ids == b.token_ids and a.text == b.text == tok.decode(a.token_ids)
    mx.clear_cache()


def test_cancelled_consumer_aborts(tiny_text):
    model, tok = tiny_text

    async def main():
        engine = TextEngine(model, tok)
        await engine.start()
        rid = await engine.add_request([5, 6, 7], SamplingOptions(max_tokens=500))
        seen = asyncio.Event()

        async def consume():
            async for out in engine.stream(rid):
                if len(out.token_ids) >= 2:
                    seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        found = engine.scheduler._find(rid)
        stats = engine.stats()
        await engine.stop()
        return found, stats

    found, stats = asyncio.run(main())
    assert found is None and stats["running"] == 0 and stats["tokens_generated"] < 500

