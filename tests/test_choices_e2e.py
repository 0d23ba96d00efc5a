"""Through the real server and the openai SDK (fp32 tiny model, --enable-mtp drafting every step):
``n`` choices from one prefill, ``max_completion_tokens``, a stream cut inside a character, stop
strings and Responses images on the media path, and routing that counts where requests were served.

References come from the text engine in-process on the same weights: /v1/completions encodes a raw
prompt exactly as they do, so token for token they are what the server must produce.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from vllm_mlx.api.utils import clean_output_text  # what the host does to a non-streamed text

from support.server import Server, png_data_url, serve
from vllm_mlx_mtp_routing.assembly import eos_token_ids
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import TextRequest

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox"  # a few tokens: one prefill chunk in-process and on the server
SAMPLED = {"temperature": 0.8, "top_p": 1.0, "extra_body": {"top_k": 0, "min_p": 0.0}}


@pytest.fixture(scope="module")
def server(tiny_vlm_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--enable-mtp", "--mtp-schedule", "always",
             "--max-num-seqs", "8")
    with serve(tiny_vlm_fp32, *flags, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai(timeout=180)


@pytest.fixture(scope="module")
def reference(tiny, tiny_vlm_fp32: Path):
    """(prompt, options, mtp) -> generated token ids, from the text engine in-process."""
    bundle, tok = tiny
    eos = eos_token_ids(tiny_vlm_fp32, json.loads((tiny_vlm_fp32 / "config.json").read_text()), tok)

    def run(prompt: str, opts: SamplingOptions, mtp: bool) -> list[int]:
        decode = MTPDecode(bundle.mtp, k=1, adaptive=False) if mtp else None
        sched = BatchScheduler(bundle.model, tok, eos_token_ids=eos, decode=decode)
        sched.add(TextRequest("r", tok.encode(prompt, add_special_tokens=False), opts))
        while sched.has_work():
            outs = [o for o in sched.step() if o.finished]
        return outs[-1].token_ids

    return run, tok


def text_of(tok, ids: list[int]) -> str:
    """As the server's non-streamed text: decoded and cleaned by the host."""
    return clean_output_text(tok.decode(ids))


def plugin_stats(server: Server) -> dict:
    return server.get("/v1/status").json()["plugins"]["mtp-routing"]


def test_n_sampled_choices_differ_and_reproduce(server: Server, client: openai.OpenAI) -> None:
    before = plugin_stats(server)
    messages = [{"role": "user", "content": "Tell me a story"}]

    def chat(**kw):
        return client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, seed=42, **SAMPLED, **kw)

    first = chat(n=3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) == 3
    assert [c.message.content for c in chat(n=3).choices] == texts  # reproducible
    assert chat().choices[0].message.content == texts[0]  # choice 0 is the request with n=1
    assert first.usage.completion_tokens == 30 and first.usage.total_tokens == first.usage.prompt_tokens + 30

    stream = chat(n=3, stream=True, stream_options={"include_usage": True})
    streamed, usage, ids = ["", "", ""], None, set()
    for chunk in stream:
        ids.add(chunk.id)
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert streamed == texts and len(ids) == 1
    assert usage.completion_tokens == 30 and usage.prompt_tokens == first.usage.prompt_tokens

    after = plugin_stats(server)
    assert after["routing"]["text"] - before["routing"]["text"] == 4  # a request counts once, whatever its n
    engine = after["text_engine"]
    assert engine["shared_prefill_rows"] - before["text_engine"]["shared_prefill_rows"] == 6  # 2 per n=3 request
    assert engine["running"] == engine["prefilling"] == engine["waiting"] == 0 and after["admission"]["running"] == 0
    # the server froze its start-up heap (the model, the host, their libraries) out of the collector's scans
    assert engine["garbage_collector"]["frozen_objects"] > 10_000
    assert all("gc_s" in s and "gc_before_s" in s for s in engine["slowest_steps"])


def test_n_completions_equal_the_engine_and_greedy_equals_without_mtp(server, client, reference) -> None:
    run, _ = reference
    seeded = client.completions.create(model=server.model, prompt=PROMPT, n=2, max_tokens=8, seed=7, **SAMPLED)
    opts = [SamplingOptions(max_tokens=8, temperature=0.8, seed=s) for s in (7, 8)]
    _, tok = reference
    assert [c.text for c in seeded.choices] == [text_of(tok, run(PROMPT, o, True)) for o in opts]

    drafted = plugin_stats(server)["mtp"]["drafted"]
    plain_ids = run(PROMPT, SamplingOptions(max_tokens=12), False)  # no MTP
    plain = text_of(tok, plain_ids)
    greedy = client.completions.create(model=server.model, prompt=PROMPT, n=3, max_tokens=12, temperature=0)
    assert [c.text for c in greedy.choices] == [plain] * 3
    stream = client.completions.create(model=server.model, prompt=PROMPT, n=3, max_tokens=12, temperature=0, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [tok.decode(plain_ids)] * 3  # streamed deltas are not cleaned
    assert plugin_stats(server)["mtp"]["drafted"] > drafted  # the rows drafted


def test_max_completion_tokens(server: Server, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count to one hundred"}]
    out = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    both = client.chat.completions.create(model=server.model, messages=messages, max_tokens=20, max_completion_tokens=4, temperature=0)
    assert both.usage.completion_tokens == 4
    r = server.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_completion_tokens": 2})
    assert r.json()["usage"]["completion_tokens"] == 2
    # stop as one string, as OpenAI allows it (the host's request model wants a list)
    full = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    cut = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0, stop=full[3:6])
    assert cut.choices[0].text == clean_output_text(full[: full.find(full[3:6])]) and cut.choices[0].finish_reason == "stop"


def _cut_inside_a_character(run, tok) -> tuple[int, int]:
    """A seed and a max_tokens whose generation ends inside a multibyte character."""
    for seed in range(200):
        ids = run(PROMPT, SamplingOptions(max_tokens=48, temperature=1.0, seed=seed), True)
        for p in range(1, len(ids)):
            if tok.decode(ids[:p]).endswith("\ufffd") and not tok.decode(ids[: p - 1]).endswith("\ufffd"):
                return seed, p
    raise AssertionError("no generation cut inside a character found")


def test_stream_cut_inside_a_character_has_no_replacement(server, client, reference) -> None:
    run, tok = reference
    seed, cut = _cut_inside_a_character(run, tok)
    expected = tok.decode(run(PROMPT, SamplingOptions(max_tokens=cut, temperature=1.0, seed=seed), True)).rstrip("\ufffd")
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": cut, "seed": seed, "temperature": 1.0, "top_p": 1.0,
          "extra_body": {"top_k": 0, "min_p": 0.0}}
    chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(chunks) == expected and not chunks[-1].endswith("\ufffd")
    assert client.completions.create(**kw).choices[0].text == expected


def test_media_path_stop_strings_and_responses_images(server, client) -> None:
    before = plugin_stats(server)["routing"]
    image = png_data_url((200, 30, 30))
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": image}}]}]
    full = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0).choices[0].message.content
    stop = full[5:8]
    cut = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full[: full.find(stop)]
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0, stream=True)
    assert clean_output_text("".join(c.choices[0].delta.content or "" for c in stream if c.choices)) == full  # untouched

    # the mlx-vlm path's greedy output for this request is cut inside a character at 40 tokens
    dark = {"type": "image_url", "image_url": {"url": png_data_url((9, 9, 9))}}
    cut_messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}, dark]}]
    long = client.chat.completions.create(model=server.model, messages=cut_messages, max_tokens=40, temperature=0).choices[0]
    assert long.finish_reason == "length" and "\ufffd" in long.message.content and not long.message.content.endswith("\ufffd")

    parts = [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": image}]
    response = client.responses.create(model=server.model, input=[{"role": "user", "content": parts}], max_output_tokens=16, temperature=0)
    assert response.output_text == full  # the image was seen, as in the chat request
    bad = server.post("/v1/responses", json={"model": server.model, "input": [
        {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]})
    assert bad.status_code == 400 and "file_id" in bad.json()["error"]["message"]
    after = plugin_stats(server)["routing"]
    assert after["media"] - before["media"] == 6 and after["text"] == before["text"]


def test_anthropic_stop_sequences_are_honoured(server: Server) -> None:
    client = server.anthropic()
    kw = {"model": server.model, "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}], "extra_body": {"temperature": 0}}
    full = client.messages.create(**kw).content[0].text
    stop = full[5:8]
    out = client.messages.create(**kw, stop_sequences=[stop])
    assert out.content[0].text == full[: full.find(stop)] and out.stop_reason == "end_turn"


def test_bad_n_and_a_refused_copy_are_plain_errors(server: Server) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert server.post("/v1/chat/completions", json={**body, "n": 0}).status_code == 400
    assert server.post("/v1/chat/completions", json={**body, "n": 99}).status_code == 400
    r = server.post("/v1/chat/completions", json={**body, "n": 3, "stream": True, "top_p": 5})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]


def test_client_gone_mid_stream_frees_every_row(server: Server) -> None:
    body = {"model": server.model, "prompt": PROMPT, "n": 3, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    for _ in range(100):
        stats = plugin_stats(server)
        if stats["text_engine"]["running"] == 0 and stats["admission"]["running"] == 0:
            break
        import time

        time.sleep(0.1)
    assert stats["text_engine"]["running"] == stats["text_engine"]["waiting"] == 0 and stats["admission"]["running"] == 0


def test_n_copies_of_several_equal_prompts_all_finish(server: Server) -> None:
    """Each copy runs its prompts in turn, so a copy's second prompt comes after the n rows shared the first one's
    prefill; it waited for that prefill's leader, long gone (a hang)."""
    body = {"model": server.model, "prompt": [PROMPT, PROMPT], "n": 2, "max_tokens": 3, "temperature": 0}
    r = server.post("/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3] and len({c["text"] for c in choices}) == 1
    stats = plugin_stats(server)
    assert stats["text_engine"]["prefilling"] == stats["text_engine"]["running"] == stats["admission"]["running"] == 0


def test_n_choices_carry_the_requests_own_options(server, client, reference) -> None:
    """Each choice is a whole copy of the request: logit_bias, penalties and logprobs apply to every choice,
    each choice with its own processor state, streamed or not, with no fallback."""
    pytest.importorskip("vllm_mlx_mtp_routing.text_engine.logits_processing")  # per-row processors on the text path
    run, tok = reference
    first = run(PROMPT, SamplingOptions(max_tokens=1), False)[0]
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logit_bias": {str(first): -100},
          "presence_penalty": 1.0, "logprobs": 2}
    one = client.completions.create(**kw).choices[0]
    both = client.completions.create(n=2, **kw).choices
    assert [c.text for c in both] == [one.text] * 2 and [c.logprobs.tokens for c in both] == [one.logprobs.tokens] * 2
    assert one.logprobs.tokens[0] != tok.decode([first])  # the bias removed the greedy token
    streamed: dict[int, list[str]] = {0: [], 1: []}
    for chunk in client.completions.create(n=2, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.logprobs.tokens if c.logprobs else []
    assert streamed == {0: one.logprobs.tokens, 1: one.logprobs.tokens}
    assert plugin_stats(server)["routing"]["fallback"] == 0


def test_no_fallback_over_the_run(server: Server) -> None:
    stats = plugin_stats(server)
    assert stats["routing"]["fallback"] == 0 and stats["fallback_reasons"] == {}
