"""Message normalization, checked against the tiny model's Qwen3.5-style chat template."""

from __future__ import annotations

import copy

import pytest
from jinja2.exceptions import TemplateError

from vllm_mlx_mtp_routing.routing.normalize import normalize_messages

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.fixture(scope="module")
def tokenizer(tiny_vlm_fp32):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_vlm_fp32))


def render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_late_system_message_renders_only_after_normalization(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "How are you?"},
    ]
    with pytest.raises(TemplateError, match="System message must be at the beginning."):
        render(tokenizer, messages)
    assert render(tokenizer, normalize_messages(messages)) == (
        "<|im_start|>system\nBe brief.\n\nAnswer in French.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_developer_and_instructions_as_codex_sends_them(tokenizer):
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "developer", "content": "Use the sandbox."},
        {"role": "user", "content": "Fix the bug."},
    ]
    with pytest.raises(TemplateError):
        render(tokenizer, messages)
    assert normalize_messages(messages) == [
        {"role": "system", "content": "You are a coding agent.\n\nUse the sandbox."},
        {"role": "user", "content": "Fix the bug."},
    ]


def test_systems_are_hoisted_in_order_and_turns_rejoin():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "s1"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
        {"role": "developer", "content": "s2"},
        {"role": "system", "content": "s3"},
    ]
    assert normalize_messages(messages) == [
        {"role": "system", "content": "s1\n\ns2\n\ns3"},
        {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "content": "c"},
    ]


def test_multimodal_contents_merge_as_part_lists(tokenizer):
    messages = [
        {"role": "user", "content": "Look:"},
        {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is it?"}]},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    out = normalize_messages(messages)
    assert out == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "text", "text": "\n\n"},
                IMAGE,
                {"type": "text", "text": "What is it?"},
                {"type": "text", "text": "\n\n"},
                {"type": "image"},
            ],
        }
    ]
    assert render(tokenizer, out).startswith(
        "<|im_start|>user\nLook:\n\n<|vision_start|><|image_pad|><|vision_end|>What is it?\n\n"
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
    )


def test_system_text_parts_merge_with_a_string():
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "one"}]},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "two"},
    ]
    assert normalize_messages(messages)[0] == {
        "role": "system",
        "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "\n\n"}, {"type": "text", "text": "two"}],
    }


def test_empty_contents_add_no_separator():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": ""},
        {"role": "user", "content": None},
        {"role": "user", "content": []},
        {"role": "user", "content": "b"},
    ]
    assert normalize_messages(messages) == [{"role": "user", "content": "a\n\nb"}]


def test_tool_turns_keep_their_identity(tokenizer):
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "Let me look."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "b.py"},
        {"role": "system", "content": "reminder"},
        {"role": "assistant", "content": "Two files."},
        {"role": "assistant", "content": "Done."},
    ]
    out = normalize_messages(messages)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "assistant", "tool", "tool", "assistant"]
    assert out[0]["content"] == "sys\n\nreminder"
    assert out[3]["tool_calls"] == [call]
    assert [m["tool_call_id"] for m in out[4:6]] == ["c1", "c2"]
    assert out[6]["content"] == "Two files.\n\nDone."
    text = render(tokenizer, out)
    results = "<tool_response>\na.py\n</tool_response>\n<tool_response>\nb.py\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in text


def test_messages_differing_in_other_keys_stay_apart():
    messages = [
        {"role": "user", "content": "a", "name": "ann"},
        {"role": "user", "content": "b", "name": "bob"},
        {"role": "user", "content": "c", "name": "bob"},
        {"role": "assistant", "content": "x", "reasoning_content": "r1"},
        {"role": "assistant", "content": "y", "reasoning_content": "r2"},
        {"role": "assistant", "content": "z", "reasoning_content": None, "reasoning": None},
    ]
    out = normalize_messages(messages)
    assert [m["content"] for m in out] == ["a", "b\n\nc", "x", "y", "z"]


def test_unknown_roles_and_content_types_pass_through():
    messages = [
        {"role": "function", "name": "f", "content": "1"},
        {"role": "function", "name": "f", "content": "2"},
        {"role": "user", "content": {"odd": True}},
        {"role": "user", "content": "x"},
    ]
    assert normalize_messages(messages) == messages


def test_caller_objects_are_never_mutated_or_shared():
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "d"}]},
        {"role": "user", "content": [IMAGE]},
        {"role": "user", "content": "q", "extra": {"k": [1]}},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "system", "content": "late"},
    ]
    before = copy.deepcopy(messages)
    out = normalize_messages(messages)
    assert messages == before
    out[0]["content"].append("x")
    out[1]["content"][0]["image_url"]["url"] = "changed"
    out[2]["extra"]["k"].append(2)
    out[3]["tool_calls"][0]["function"]["arguments"] = {}
    assert messages == before


def test_idempotent_and_empty():
    assert normalize_messages([]) == []
    messages = [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "s"},
        {"role": "user", "content": [IMAGE]},
        {"role": "assistant", "content": "b"},
    ]
    once = normalize_messages(messages)
    assert normalize_messages(once) == once
