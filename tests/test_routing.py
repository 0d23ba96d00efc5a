"""Request classification: which path serves which request."""

from __future__ import annotations

import pytest

from vllm_mlx_mtp_routing.routing import has_media, sampling_options, text_path_gap


def user(content: object) -> dict:
    return {"role": "user", "content": content}


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_image", "image_url": "https://x/y.png"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},  # Anthropic
        {"type": "video_url", "video_url": {"url": "file:///v.mp4"}},
        {"type": "video", "video": "file:///v.mp4"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "file:///a.wav"}},
        {"image_url": {"url": "https://x/y.png"}},  # untyped part
    ],
)
def test_any_media_part_routes_to_media(part: dict) -> None:
    messages = [{"role": "system", "content": "s"}, user([{"type": "text", "text": "what is it?"}, part])]
    assert has_media(messages, {})


@pytest.mark.parametrize("key", ["images", "videos", "audio"])
def test_media_arguments_route_to_media(key: str) -> None:
    assert has_media([user("hi")], {key: ["x.png"]})
    assert has_media(None, {key: ["x.png"]})


def test_text_only_stays_text() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        user([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "result", "tool_call_id": "1"},
    ]
    assert not has_media(messages, {"images": None, "videos": []})


@pytest.mark.parametrize(
    "options, gap",
    [
        ({"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.0, "repetition_penalty": 1.0}, None),
        # served on the text path since issue 14: processors, penalties; since issue 17: SpecPrefill
        ({"presence_penalty": 0.5, "repetition_penalty": 1.1, "frequency_penalty": 0.3}, None),
        ({"logits_processors": [object()]}, None),
        ({"specprefill": True, "specprefill_keep_pct": 0.2}, None),
    ],
)
def test_text_path_gaps(options: dict, gap: str | None) -> None:
    found = text_path_gap(options)
    assert (found is None) if gap is None else (found is not None and gap in found)


def test_sampling_options_from_host_kwargs() -> None:
    opts = sampling_options({"max_tokens": 7, "temperature": 0.0, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "stop": "END", "seed": 3})
    assert (opts.max_tokens, opts.temperature, opts.top_p, opts.top_k, opts.min_p, opts.stop, opts.seed) == (7, 0.0, 0.9, 5, 0.1, ["END"], 3)
    assert (opts.presence_penalty, opts.frequency_penalty, opts.repetition_penalty, opts.logprobs, opts.top_logprobs) == (0.0, 0.0, 1.0, False, 0)
    proc = lambda tokens, logits: logits  # noqa: E731
    opts = sampling_options({"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logprobs": True,
                             "top_logprobs": 4, "logits_processors": [proc]})
    assert (opts.presence_penalty, opts.frequency_penalty, opts.repetition_penalty, opts.logprobs, opts.top_logprobs) == (0.5, -0.5, 1.2, True, 4)
    assert opts.logits_processors == [proc]


def test_template_errors_become_400_on_both_paths() -> None:
    import asyncio
    from types import SimpleNamespace

    import jinja2

    from vllm_mlx_mtp_routing.plugin_api.errors import RequestRejected
    from vllm_mlx_mtp_routing.routing import RoutingEngine, RoutingSettings, ServingParts, TextPath

    class HostWithStrictTemplate:
        is_mllm = True

        def _apply_chat_template(self, *args: object, **kwargs: object) -> str:
            raise jinja2.TemplateError("Conversation roles must alternate")

        async def chat(self, messages: list, **kwargs: object) -> object:
            self._apply_chat_template(messages)
            return None

    router = RoutingEngine(HostWithStrictTemplate(), RoutingSettings())
    # the text path is up; the template fails before it is used
    idle = SimpleNamespace(prefix_cache=None, start=lambda: asyncio.sleep(0))
    text = TextPath(idle, prefill_budget=None, mtp=None, prompts=None, warm_prefixes=frozenset(), vocab_size=2)
    router.attach(ServingParts(tokenizer=None, context_tokens=None, tokens_per_media_item=0, admission=None, text=text))
    asyncio.run(router.start_text_path())
    with pytest.raises(RequestRejected) as text_err:
        asyncio.run(router.chat([{"role": "user", "content": "hi"}], max_tokens=2))
    assert text_err.value.status_code == 400 and "roles must alternate" in text_err.value.message
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(RequestRejected) as media_err:
        asyncio.run(router.chat(image, max_tokens=2))
    assert media_err.value.status_code == 400
