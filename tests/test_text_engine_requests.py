"""Request semantics of the text engine's scheduler: stops, max_tokens, abort, usage, streaming text."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_mlx_mtp_routing.text_engine.detokenize import StopText
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.state import TextRequest


def _sched(tiny_text, **kw):
    model, tok = tiny_text
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("prefill_step_size", 16)
    return BatchScheduler(model, tok, **kw)


def _drain(sched):
    outs: dict[str, list] = {}
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _run(tiny_text, prompt, options, **kw):
    sched = _sched(tiny_text, **kw)
    sched.add(TextRequest("r", prompt, options))
    return _drain(sched)["r"]


@pytest.fixture(scope="module")
def prompt(tiny_text):
    return tiny_text[1].encode("def hello(world):\n    return")


@pytest.fixture(scope="module")
def reference(tiny_text, prompt):
    """Greedy run of 24 tokens with no stops: (token_ids, text)."""
    final = _run(tiny_text, prompt, SamplingOptions(max_tokens=24))[-1]
    assert final.finish_reason == "length" and len(final.token_ids) == 24
    return final.token_ids, final.text


def _assert_stream_consistent(outs):
    assert all(not o.finished for o in outs[:-1]) and outs[-1].finished
    assert "".join(o.new_text for o in outs) == outs[-1].text
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
    for o in outs:
        assert o.completion_tokens == len(o.token_ids)


def test_max_tokens_and_usage(tiny_text, prompt, reference):
    outs = _run(tiny_text, prompt, SamplingOptions(max_tokens=5))
    final = outs[-1]
    assert final.finish_reason == "length"
    assert final.token_ids == reference[0][:5]
    assert final.prompt_tokens == len(prompt) and final.completion_tokens == 5
    # this cut falls inside a character: its bytes are dropped, never emitted as U+FFFD
    assert final.text == tiny_text[1].decode(final.token_ids).removesuffix("\ufffd")
    _assert_stream_consistent(outs)


def test_max_tokens_one(tiny_text, prompt, reference):
    outs = _run(tiny_text, prompt, SamplingOptions(max_tokens=1))
    assert len(outs) == 1 and outs[0].token_ids == reference[0][:1]
    assert outs[0].finish_reason == "length"


def test_stop_token_ids(tiny_text, prompt, reference):
    tokens, _ = reference
    j = 6
    stop_id = tokens[j]
    first = tokens.index(stop_id)
    outs = _run(tiny_text, prompt, SamplingOptions(max_tokens=24, stop_token_ids=[stop_id]))
    final = outs[-1]
    assert final.finish_reason == "stop"
    assert final.token_ids == tokens[: first + 1]  # the stop token is reported and counted
    assert final.completion_tokens == first + 1
    assert final.text == tiny_text[1].decode(tokens[:first])  # but not in the text
    _assert_stream_consistent(outs)


def test_eos_from_engine_setting(tiny_text, prompt, reference):
    tokens, _ = reference
    outs = _run(tiny_text, prompt, SamplingOptions(max_tokens=24), eos_token_ids=[tokens[3]])
    assert outs[-1].finish_reason == "stop" and outs[-1].token_ids == tokens[: tokens.index(tokens[3]) + 1]


def _piece_ends(tok, tokens):
    return [len(tok.decode(tokens[: k + 1])) for k in range(len(tokens))]


def test_stop_string_spanning_tokens(tiny_text, prompt, reference):
    tok = tiny_text[1]
    tokens, full = reference
    ends = _piece_ends(tok, tokens)
    # A stop string from the last 2 chars of one token's text to the first 2 of the next ones.
    k = next(k for k in range(2, len(tokens) - 2) if ends[k] - ends[k - 1] >= 2 and ends[k + 1] - ends[k] >= 2)
    stop = full[ends[k] - 2 : ends[k] + 2]
    at = full.find(stop)
    needed = next(n for n in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:n]))

    outs = _run(tiny_text, prompt, SamplingOptions(max_tokens=24, stop=[stop]))
    final = outs[-1]
    assert final.finish_reason == "stop"
    assert final.text == full[:at]
    assert final.token_ids == tokens[:needed] and final.completion_tokens == needed
    assert all(stop not in o.new_text for o in outs)
    _assert_stream_consistent(outs)


def test_unmatched_stop_prefix_is_released(tiny_text, prompt, reference):
    """Text held back as a possible stop start is emitted once the stop cannot match."""
    tokens, full = reference
    stop = full[3:6] + "\x00never"
    outs = _run(tiny_text, prompt, SamplingOptions(max_tokens=24, stop=[stop, "\x01"]))
    assert outs[-1].finish_reason == "length" and outs[-1].text == full
    _assert_stream_consistent(outs)


def test_streaming_detokenizer_holds_partial_utf8(tiny_text):
    tok = tiny_text[1]
    text = "héllo 😀 wörld"
    ids = tok.encode(text)
    st = StopText(tok, [])
    released = ""
    for t in ids:
        st.add(t)
        new = st.take_new(final=False)
        assert "\ufffd" not in new
        released += new
    st.finish()
    released += st.take_new(final=True)
    assert released == tok.decode(ids) == text


@pytest.mark.parametrize("cut", [1, 2, 3])  # inside "😀" (4 bytes): after its 1st, 2nd, 3rd byte
def test_generation_cut_inside_a_character_ends_without_replacement(tiny_text, cut):
    tok = tiny_text[1]
    ids = tok.encode("ok 😀")
    whole = tok.encode("ok ")
    assert ids[: len(whole)] == whole and len(ids) == len(whole) + 4  # one byte token per byte of the emoji
    st = StopText(tok, [])
    released = ""
    for t in ids[: len(whole) + cut]:
        st.add(t)
        released += st.take_new(final=False)
    st.finish()
    released += st.take_new(final=True)
    assert released == "ok "  # the half character is dropped, never emitted as U+FFFD


def test_abort_waiting_prefilling_and_running(tiny_text):
    model, tok = tiny_text
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 3000, size=n).tolist() for n in (5, 9, 80, 7, 4)]
    opts = SamplingOptions(max_tokens=10)

    def alone(p):
        s = _sched(tiny_text, max_num_seqs=1)
        s.add(TextRequest("x", p, opts))
        return _drain(s)["x"][-1].token_ids

    sched = _sched(tiny_text, max_num_seqs=3)
    for i, p in enumerate(prompts):
        sched.add(TextRequest(str(i), p, opts))
    outs: dict[str, list] = {}

    def step():
        for o in sched.step():
            outs.setdefault(o.request_id, []).append(o)

    step()
    step()
    assert [s.rid for s in sched.running] == ["0", "1"] and sched.prefilling[0].rid == "2"
    aborted = {
        "0": sched.abort("0"),  # running, first row
        "2": sched.abort("2"),  # mid-prefill (80 tokens, 16 per step)
        "4": sched.abort("4"),  # still waiting
    }
    assert sched.abort("0") is None and sched.abort("nope") is None
    for rid, out in aborted.items():
        assert out.finished and out.finish_reason == "abort" and out.request_id == rid
    assert aborted["0"].completion_tokens == len(outs["0"][-1].token_ids) > 0
    assert aborted["4"].completion_tokens == 0 and aborted["4"].prompt_tokens == len(prompts[4])
    while sched.has_work():
        step()
    for rid in ("1", "3"):  # the survivors are unaffected by rows leaving around them
        assert outs[rid][-1].token_ids == alone(prompts[int(rid)])
        assert outs[rid][-1].finish_reason == "length"
    assert sched.cache.batch_size == 0 and not sched.running


def test_max_num_seqs_bounds_batch(tiny_text):
    model, tok = tiny_text
    sched = _sched(tiny_text, max_num_seqs=2)
    for i in range(5):
        sched.add(TextRequest(str(i), [11 + i, 12, 13], SamplingOptions(max_tokens=4)))
    seen = 0
    while sched.has_work():
        sched.step()
        seen = max(seen, len(sched.running) + len(sched.prefilling))
        assert len(sched.running) + len(sched.prefilling) <= 2
    stats = sched.stats()
    assert seen == 2 and max(stats["batch_size_histogram"]) == 2
    assert stats["tokens_generated"] == 20


def test_long_prompt_prefill_interleaves_with_decode(tiny_text):
    """A long prompt advances one chunk per step while running rows keep decoding."""
    sched = _sched(tiny_text, prefill_step_size=8)
    sched.add(TextRequest("short", [20, 21, 22], SamplingOptions(max_tokens=30)))
    sched.step()
    sched.add(TextRequest("long", list(range(100, 181)), SamplingOptions(max_tokens=2)))
    tokens_before = None
    for _ in range(10):  # 80 prompt tokens to prefill = 10 chunks of 8
        outs = {o.request_id: o for o in sched.step()}
        assert "short" in outs and len(outs["short"].new_token_ids) == 1
        tokens_before = outs["short"].completion_tokens
    # 11 steps: the first read at once (nothing was in flight), each later one's tokens at the next (decode ahead)
    assert tokens_before == 11
    assert [s.rid for s in sched.running] == ["short"]  # prefilled; longer than a chunk, it joins at the next step's start
    sched.step()  # it joins; its first decode step is launched
    assert [s.rid for s in sched.running] == ["short", "long"]
    outs = {o.request_id: o for o in sched.step()}
    assert len(outs["long"].new_token_ids) == 1


def test_rejects_bad_requests(tiny_text):
    sched = _sched(tiny_text)
    with pytest.raises(ValueError):
        sched.add(TextRequest("e", [], SamplingOptions()))
    sched.add(TextRequest("a", [1, 2], SamplingOptions()))
    with pytest.raises(ValueError):
        sched.add(TextRequest("a", [1, 2], SamplingOptions()))
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(min_p=2)):
        with pytest.raises(ValueError):
            SamplingOptions(**bad)
