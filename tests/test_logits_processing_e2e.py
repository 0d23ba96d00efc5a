"""logit_bias, penalties, logprobs and JSON mode on the text path, through the real server and the openai SDK.

fp32 tiny model: outputs checked against references computed here from the same checkpoint (a
direct forward pass at every position, penalties in numpy). The trained tiny model (its MTP head
really accepts): JSON mode ends in valid JSON, and with --enable-mtp every option gives the greedy
output it gives without MTP, alone and in a batch of 4. Nothing falls back to the mlx-vlm path.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from test_mtp_e2e import MTP_ALWAYS  # its server with MTP is this module's too (shared_server)

from logits_reference import generated_logprobs, reference_greedy
from support.server import Server, serve
from vllm_mlx_mtp_routing.text_engine.detokenize import eos_ids_of

pytestmark = pytest.mark.server

FLAGS = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "4", "--prefill-step-size", "32")
TRAINED = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen35-trained"
PROMPT = "import os\nimport sys\n\ndef main(argv):\n    "
REPEATS = "the the the the"  # greedy repeats tokens after it: every penalty changes the output


@pytest.fixture(scope="module")
def server(tiny_vlm_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tiny_vlm_fp32, *FLAGS, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def client(server: Server) -> openai.OpenAI:
    return server.openai(timeout=180)


def routing(server: Server) -> dict[str, int]:
    return server.get("/v1/status").json()["plugins"]["mtp-routing"]["routing"]


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_penalties_change_output_exactly_as_the_reference(server: Server, tiny) -> None:
    bundle, tok = tiny
    prompt = encode(tok, REPEATS)
    eos = eos_ids_of(tok)
    plain = client(server).completions.create(model=server.model, prompt=REPEATS, max_tokens=20, temperature=0).choices[0].text
    assert plain == tok.decode([t for t in reference_greedy(bundle.model, prompt, 20, eos=eos) if t not in eos])
    cases = [({"presence_penalty": 1.5}, dict(presence=1.5)), ({"frequency_penalty": 1.2}, dict(frequency=1.2)),
             ({"extra_body": {"repetition_penalty": 1.6}}, dict(repetition=1.6))]
    for kwargs, ref_kwargs in cases:
        out = client(server).completions.create(model=server.model, prompt=REPEATS, max_tokens=20, temperature=0, logprobs=0, **kwargs)
        ref = reference_greedy(bundle.model, prompt, 20, eos=eos, **ref_kwargs)
        assert out.choices[0].text == tok.decode([t for t in ref if t not in eos]), kwargs
        assert out.choices[0].text != plain, kwargs  # the penalty changed the output
    assert routing(server)["fallback"] == 0


def test_logit_bias_removes_the_greedy_token(server: Server, tiny) -> None:
    bundle, tok = tiny
    messages = [{"role": "user", "content": "def add(a, b):"}]
    prompt = encode(tok, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    greedy = reference_greedy(bundle.model, prompt, 8, eos=eos_ids_of(tok))
    first = greedy[0]
    out = client(server).chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0,
                                                 logit_bias={str(first): -100}, logprobs=True)
    assert out.usage.prompt_tokens == len(prompt)
    ref = reference_greedy(bundle.model, prompt, 8, bias={first: -100.0}, eos=eos_ids_of(tok))
    assert first not in ref and ref != greedy
    assert [c.token for c in out.choices[0].logprobs.content] == [tok.decode([t]) for t in ref if t not in eos_ids_of(tok)]
    for bad in ({"999999": -100}, {str(first): -101}):  # an id past the logits, a bias out of OpenAI's range
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client(server).chat.completions.create(model=server.model, messages=messages, max_tokens=2, logit_bias=bad)
    # completions too (the host's request model has no logit_bias; the plugin builds the host's processor)
    plain = encode(tok, PROMPT)
    first = reference_greedy(bundle.model, plain, 1)[0]
    text = client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                             logit_bias={str(first): -100}).choices[0].text
    assert text == tok.decode(reference_greedy(bundle.model, plain, 6, bias={first: -100.0}, eos=eos_ids_of(tok)))
    assert routing(server)["fallback"] == 0


def _check(bundle, prompt: list[int], entries: list[tuple[int, float, dict[int, float]]], top: int) -> None:
    ref = generated_logprobs(bundle.model, prompt, [t for t, _, _ in entries])
    for (t, lp, alts), r in zip(entries, ref):
        assert abs(lp - r[t]) < 1e-4
        assert len(alts) >= top
        assert all(abs(r[a] - v) < 1e-4 for a, v in alts.items())
        best = np.sort(r)[::-1][:top]
        np.testing.assert_allclose(sorted(alts.values(), reverse=True)[:top], best, atol=1e-4)


def test_logprobs_equal_the_models_log_softmax(server: Server, tiny) -> None:
    bundle, tok = tiny
    c = client(server)
    prompt = encode(tok, PROMPT)
    # completions, non-stream and stream
    out = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    toks = reference_greedy(bundle.model, prompt, 8, eos=eos_ids_of(tok))
    assert lp.tokens == [tok.decode([t]) for t in toks] and "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    _check(bundle, prompt, [(t, v, {}) for t, v in zip(toks, lp.token_logprobs)], 0)
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(model=server.model, prompt=PROMPT, max_tokens=8,
                                                                       temperature=0, logprobs=3, stream=True) if ch.choices]
    assert sum((s.token_logprobs for s in streamed if s), []) == lp.token_logprobs
    # chat, non-stream and stream
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat_prompt = encode(tok, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    toks = reference_greedy(bundle.model, chat_prompt, 6)
    out = c.chat.completions.create(model=server.model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4)
    content = out.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in toks] and len(content) == out.usage.completion_tokens
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 4 for e in content)
    top_ids = [{int(np.argsort(r)[::-1][j]): None for j in range(4)} for r in generated_logprobs(bundle.model, chat_prompt, toks)]
    _check(bundle, chat_prompt, [(t, e.logprob, {a: alt.logprob for a, alt in zip(ti, e.top_logprobs)})
                                 for t, e, ti in zip(toks, content, top_ids)], 4)
    chunks = list(c.chat.completions.create(model=server.model, messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=4, stream=True))
    streamed = sum((ch.choices[0].logprobs.content for ch in chunks if ch.choices and ch.choices[0].logprobs), [])
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # without logprobs the field stays null, as OpenAI sends it
    assert c.chat.completions.create(model=server.model, messages=messages, max_tokens=2, temperature=0).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        c.chat.completions.create(model=server.model, messages=messages, max_tokens=2, logprobs=True, top_logprobs=21)
    assert routing(server)["fallback"] == 0


# -- the trained tiny model: JSON mode, and every option with MTP equals without ------------------

# 24 tokens: each option has changed the output by then (the penalties once the reply repeats a token, ~16); JSON
# mode gets room to close the object and stop.
MAX_TOKENS = 24
OPTIONS = {
    "json": {"response_format": {"type": "json_object"}, "max_tokens": 32},
    "logit_bias": {"logit_bias": {"258": -100, "198": -100}},  # the indent and the newline: both come early
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.0},
    "repetition": {"extra_body": {"repetition_penalty": 1.5}},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    # The model closes its reasoning at once: the bias keeps it open (no </think>, no end of reply), so the budget's
    # processor is what closes it.
    "thinking": {"extra_body": {"thinking_token_budget": 3}, "logit_bias": {"4025": -100, "4002": -100, "4000": -100},
                 "logprobs": True},
    "plain": {},
}
CODE = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\nimport sys\n\ndef main(argv=None):\n    parser = ",
        "for i in range(10):"]


def _greedy(server: Server, name: str, prompt: str) -> tuple[str, str | None, str | None]:
    out = client(server).chat.completions.create(model=server.model, messages=[{"role": "user", "content": prompt}],
                                                 temperature=0, **{"max_tokens": MAX_TOKENS, **OPTIONS[name]})
    lp = out.choices[0].logprobs
    entries = json.dumps([(e.token, round(e.logprob, 3)) for e in lp.content]) if lp else None
    return out.choices[0].message.content or "", entries, out.choices[0].finish_reason


def _all(server: Server) -> dict:
    alone = {name: _greedy(server, name, CODE[0]) for name in OPTIONS}
    with ThreadPoolExecutor(4) as pool:  # a batch of 4, each row with its own option
        batched = {names: list(pool.map(lambda a: _greedy(server, *a), zip(names, CODE)))
                   for names in (("json", "logit_bias", "presence", "logprobs"), ("frequency", "repetition", "thinking", "plain"))}
    return {"alone": alone, "batched": batched}


@pytest.mark.skipif(not TRAINED.is_dir(), reason="the trained tiny model is not in the checkout")
def test_every_option_with_mtp_equals_without_and_json_mode_is_valid(shared_server: Callable[..., Server]) -> None:
    server = shared_server(TRAINED, *FLAGS, *MTP_ALWAYS)  # test_mtp_e2e's servers, with MTP and without
    before = server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"]
    with_mtp = _all(server)
    after = server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"]
    drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]  # a shared server
    assert routing(server)["fallback"] == 0
    server = shared_server(TRAINED, *FLAGS)
    without = _all(server)
    assert routing(server)["fallback"] == 0
    assert with_mtp == without
    alone = with_mtp["alone"]
    for name in ("logit_bias", "presence", "frequency", "repetition", "thinking"):
        assert alone[name][0] != alone["plain"][0], name  # each option really changed the output
    # the host's thinking-budget processor closed the reasoning after 3 tokens (the prompt opens it)
    assert [t for t, _ in json.loads(alone["thinking"][1])][3] == "</think>"
    assert accepted > 0 and drafted > accepted  # drafts kept and rejected
    text, _, finish = alone["json"]
    assert isinstance(json.loads(text), dict) and finish == "stop"  # the processor closed the JSON and ended it
    assert with_mtp["alone"]["logprobs"][1] is not None
