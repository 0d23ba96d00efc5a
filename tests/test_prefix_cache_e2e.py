"""The prefix cache through the real server on loopback, with the openai and anthropic clients:
on by default, off with --disable-prefix-cache, --cache-memory-mb as its budget, --warm-prompts
filling it at start-up, its counters in /v1/status, reused tokens in the responses' usage, and
outputs equal to the server without the cache (fp32 tiny model, greedy)."""

from __future__ import annotations

import json

import openai
import pytest

from support.server import serve

BASE = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "4", "--prefill-step-size", "64")
SYSTEM = (
    "You are a careful assistant for a software team. Answer briefly, cite files by path, never invent APIs, "
    "and ask before running anything that writes to disk. Tools: read_file(path), list_dir(path), grep(pattern). "
) * 3
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def _client(server) -> openai.OpenAI:
    client = server.openai()
    client.served_model = server.model
    return client


def _status(server) -> dict:
    with server.client() as c:
        return c.get("/v1/status").json()["plugins"]["mtp-routing"]


def _chat(client, messages, **kw):
    r = client.chat.completions.create(model=client.served_model, messages=messages, max_tokens=12, temperature=0.0, **kw)
    return r.choices[0].message.content, r.usage


def _conversation_turns():
    """Three requests: a first turn, another user's first turn (same system + tools), the first
    conversation's second turn (after a tool result)."""
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the config parser?"}]
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the tests please."}]
    return first, other


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("prefix-e2e")


def test_server_hits_and_matches_the_uncached_server(tiny_vlm_fp32, logs):
    first, other = _conversation_turns()
    outputs = {}
    for name, flags in (("cached", ()), ("uncached", ("--disable-prefix-cache",)), ("mtp", ("--enable-mtp",))):
        with serve(tiny_vlm_fp32, *BASE, *flags, log_dir=logs) as server:
            client = _client(server)
            a, ua = _chat(client, first, tools=TOOLS)
            b, ub = _chat(client, other, tools=TOOLS)
            second = [*first, {"role": "assistant", "content": a}, {"role": "user", "content": "And the tests for it?"}]
            c, uc = _chat(client, second, tools=TOOLS)
            again, ud = _chat(client, second, tools=TOOLS)  # the whole prompt again
            outputs[name] = [a, b, c, again]
            stats = _status(server)["prefix_cache"]
            if name == "uncached":
                assert stats == {"enabled": False}
                assert ub.prompt_tokens_details is None or not ub.prompt_tokens_details.cached_tokens
                r = client.responses.create(model=server.model, input="hello", max_output_tokens=2, temperature=0)
                assert r.usage.input_tokens_details.cached_tokens == 0
                continue
            if name == "mtp":  # MTP on: hits as without it, the same greedy output
                assert stats["hits"] == 3 and _status(server)["mtp"]["steps_with_mtp"] + _status(server)["mtp"]["steps_without_mtp"] > 0
                continue
            assert stats["enabled"] and stats["lookups"] == 4 and stats["hits"] == 3
            assert stats["entries"] > 0 and 0 < stats["bytes"] <= stats["budget_bytes"]
            assert set(stats["hits_by_kind"]) >= {"system"}
            cached = [u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in (ua, ub, uc, ud)]
            assert cached[0] == 0 and cached[1] > 100 and cached[2] > cached[1] and cached[3] == ud.prompt_tokens - 1
            assert stats["hit_tokens"] == sum(cached)
            assert stats["prefilled_tokens"] == sum(u.prompt_tokens - 1 for u in (ua, ub, uc, ud)) - sum(cached)
            # Anthropic (no tools: another system block): the reused tokens as cache_read_input_tokens
            ac = server.anthropic()
            usages = [
                ac.messages.create(model=server.model, system=SYSTEM, max_tokens=5,
                                   messages=[{"role": "user", "content": q}]).usage
                for q in ("Summarise the repo.", "Name one test.")
            ]
            reads = [u.cache_read_input_tokens for u in usages]
            assert reads[0] == 0 and reads[1] > 100
            # as Anthropic counts: input_tokens + cache_read_input_tokens is the whole prompt (the two prompts
            # differ only in a short user message), the reused part is not counted twice
            assert abs(usages[1].input_tokens + reads[1] - usages[0].input_tokens) <= 4
            assert usages[1].input_tokens < usages[0].input_tokens - 100
            # streamed, the same counts: message_start (held until the first token) and message_delta report them
            with ac.messages.stream(model=server.model, system=SYSTEM, max_tokens=5,
                                    messages=[{"role": "user", "content": "Name one test."}]) as stream:
                start = next(e for e in stream if e.type == "message_start").message.usage
                streamed = stream.get_final_message().usage
            prompt = usages[1].input_tokens + reads[1]
            for u in (start, streamed):
                assert u.cache_read_input_tokens >= reads[1] and u.input_tokens + u.cache_read_input_tokens == prompt
            assert streamed.output_tokens == usages[1].output_tokens
            # /v1/responses, streamed or not: input_tokens_details.cached_tokens
            responses = [client.responses.create(model=server.model, instructions=SYSTEM, input=q, max_output_tokens=5,
                                                 temperature=0) for q in ("Which file has main?", "Which file has tests?")]
            events = list(client.responses.create(model=server.model, instructions=SYSTEM, input="Any docs?",
                                                  max_output_tokens=5, temperature=0, stream=True))
            done = next(e for e in events if e.type == "response.completed").response
            for r in (*responses[1:], done):
                assert r.usage.input_tokens_details.cached_tokens > 100
                assert r.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
            admission = _status(server)["admission"]
            assert admission["running"] == 0 and admission["prefix_cache_bytes"] == _status(server)["prefix_cache"]["bytes"]
    assert outputs["cached"] == outputs["uncached"] == outputs["mtp"]


def test_flags_budget_and_warm_prompts(tiny_vlm_fp32, logs, tmp_path):
    warm = tmp_path / "warm.json"
    warm.write_text(json.dumps([[{"role": "system", "content": SYSTEM}]]))
    with serve(tiny_vlm_fp32, *BASE, "--cache-memory-mb", "64", "--warm-prompts", str(warm), "--enable-metrics",
               log_dir=logs) as server:
        stats = _status(server)["prefix_cache"]
        assert stats["budget_bytes"] == 64 * 2**20
        assert stats["entries"] >= 1  # the warm-up's system prefix
        client = _client(server)
        _, usage = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}])
        assert usage.prompt_tokens_details.cached_tokens > 100  # the very first request hits
        stats = _status(server)["prefix_cache"]
        assert stats["hits_by_kind"].get("system", 0) >= 1
        with server.client() as c:
            metrics = c.get("/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("vllm_mlx_mtp_routing_prefix_cache_")}
        assert values["vllm_mlx_mtp_routing_prefix_cache_hits_total"] == stats["hits"]
        assert values["vllm_mlx_mtp_routing_prefix_cache_budget_bytes"] == 64 * 2**20
        assert values["vllm_mlx_mtp_routing_prefix_cache_entries"] == stats["entries"]
    for bad in (("--cache-memory-percent", "0"), ("--cache-memory-percent", "1.5")):
        with pytest.raises(RuntimeError, match=r"exited with 2[\s\S]*--cache-memory-percent"):
            with serve(tiny_vlm_fp32, *BASE, *bad, log_dir=logs, startup_timeout=60):
                pass


def test_bounded_memory_many_distinct_long_prompts(tiny_vlm_fp32, logs):
    """A small budget: 6 distinct long prompts (~600 tokens, a third of the budget each: evictions from the
    fourth on) leave the cache under it after each of them, evictions counted, admission counting the cache,
    nothing crashing."""
    with serve(tiny_vlm_fp32, *BASE, "--cache-memory-mb", "1", log_dir=logs) as server:
        client = _client(server)
        for i in range(6):
            system = f"Persona {i}: " + " ".join(f"w{(i * 37 + j) % 997}" for j in range(150))
            _chat(client, [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
            if i >= 2:  # full from the third on: each later prompt evicts
                stats = _status(server)["prefix_cache"]
                assert stats["bytes"] <= stats["budget_bytes"] == 2**20
        status = _status(server)
        stats = status["prefix_cache"]
        assert stats["evictions"] > 0 and stats["entries"] > 0
        assert status["admission"]["prefix_cache_bytes"] == stats["bytes"]
        assert status["admission"]["running"] == 0 and status["text_engine"]["running"] == 0
        with server.client() as c:
            assert c.get("/health").status_code == 200
