"""Snapshot positions found from the chat template (Qwen3.5 ChatML with a <think> generation prompt)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_mlx_mtp_routing.prefix_cache.boundaries import snapshot_positions

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen35-trained"
SYSTEM = "You are a careful assistant for a software team. Answer briefly and cite files by path. " * 4
TOOLS = [{"name": "read_file", "description": "Read a file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def _positions(tok, messages, tools=None):
    def render(m):
        return tok.apply_chat_template(m, tools=tools, tokenize=False, add_generation_prompt=True)

    def encode(s):
        return tok.encode(s, add_special_tokens=False)

    prompt = render(messages)
    ids = encode(prompt)
    return snapshot_positions(render, encode, messages, prompt, ids), ids, render, encode


def test_positions_are_prefixes_that_later_requests_share(tok):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the config parser?"}]
    pos, ids, render, encode = _positions(tok, first, TOOLS)
    kinds = dict((k, p) for p, k in pos)
    assert set(kinds) == {"system", "prompt"}  # one user message: no separate message boundary
    # another user's first turn shares the system + tools block up to the system position
    other = encode(render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the tests"}]))
    assert other[: kinds["system"]] == ids[: kinds["system"]] and other[kinds["system"]] != ids[kinds["system"]]
    # the next turn (the assistant reply re-rendered, then a tool result) shares the end-of-turn position
    turn2 = [*first, {"role": "assistant", "content": "In src/config.py."}, {"role": "tool", "content": "def parse(): ..."}]
    nxt = encode(render(turn2))
    assert nxt[: kinds["prompt"]] == ids[: kinds["prompt"]]
    # after a user message the template drops the reply's think block: the end of the prompt
    # (inside "<think>") is no prefix of that next turn, the end-of-turn position is
    turn2u = [*first, {"role": "assistant", "content": "In src/config.py."}, {"role": "user", "content": "Thanks"}]
    nxtu = encode(render(turn2u))
    assert nxtu[: kinds["prompt"]] == ids[: kinds["prompt"]] and nxtu[: len(ids) - 1] != ids[: len(ids) - 1]
    pos2, ids2, _, _ = _positions(tok, turn2, TOOLS)
    kinds2 = dict((k, p) for p, k in pos2)
    assert kinds2["system"] == kinds["system"] and kinds2["message"] > kinds["prompt"]  # the tool result's start
    assert all(16 <= p < len(ids2) - 1 for p, _ in pos2)


def test_a_template_error_gives_no_positions():
    def render(m):
        raise ValueError("System message must be at the beginning.")

    assert snapshot_positions(render, lambda s: [1] * len(s), [{"role": "user", "content": "x"}], "x" * 40, list(range(40))) == []
