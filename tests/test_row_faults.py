"""One request's fault stays its own: bad parameters are refused before admission, a fault inside a step
fails its row alone and the batch carries on; the routing decorator's surface is deliberate."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from vllm_mlx_mtp_routing.plugin_api.errors import RequestRejected
from vllm_mlx_mtp_routing.routing.request_options import sampling_options
from vllm_mlx_mtp_routing.routing.request_validation import fit_to_context, validate_logit_bias, validate_parameters
from vllm_mlx_mtp_routing.text_engine.row_check import RowOptionsError, preflight
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.state import TextRequest


def _drain(sched: BatchScheduler) -> dict[str, list]:
    outs: dict[str, list] = {}
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_a_rows_sampling_fault_fails_that_row_alone(tiny_text) -> None:
    model, tok = tiny_text
    sched = BatchScheduler(model, tok, max_num_seqs=4, prefill_step_size=16)
    for i in range(3):
        sched.add(TextRequest(f"ok{i}", tok.encode(f"def f{i}(x):"), SamplingOptions(max_tokens=12, temperature=0.7, seed=i)))
    sched.add(TextRequest("bad", tok.encode("class A:"), SamplingOptions(max_tokens=12, temperature=0.7, seed=5)))
    sched.step()  # all four prefilled and running
    bad = next(s for s in sched.running if s.rid == "bad")

    def broken(logits):
        raise OverflowError("seed out of range for this row")

    bad.sampler.sample = broken
    outs = _drain(sched)
    assert outs["bad"][-1].finish_reason == "error" and "OverflowError" in outs["bad"][-1].error
    for i in range(3):
        assert outs[f"ok{i}"][-1].finish_reason == "length" and outs[f"ok{i}"][-1].completion_tokens == 12


def test_a_rows_stop_handling_fault_fails_that_row_alone(tiny_text) -> None:
    model, tok = tiny_text
    sched = BatchScheduler(model, tok, max_num_seqs=4, prefill_step_size=16)
    sched.add(TextRequest("ok", tok.encode("import os"), SamplingOptions(max_tokens=10)))
    sched.add(TextRequest("bad", tok.encode("import sys"), SamplingOptions(max_tokens=10, stop=["zz"])))
    sched.step()
    bad = next(s for s in sched.running if s.rid == "bad")

    def broken(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken detokenizer")

    bad.text.add = broken
    outs = _drain(sched)
    assert outs["bad"][-1].finish_reason == "error"
    assert outs["ok"][-1].finish_reason == "length" and outs["ok"][-1].completion_tokens == 10
    assert not sched.running


def test_preflight_refuses_unusable_options() -> None:
    preflight(SamplingOptions(temperature=0.5, seed=2**64 - 1))
    with pytest.raises(RowOptionsError):
        preflight(SamplingOptions(temperature=0.5, seed=2**64))


@pytest.mark.parametrize("field,value", [
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("seed", True), ("temperature", -1), ("temperature", float("nan")),
    ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("min_p", 2), ("frequency_penalty", 2.5), ("presence_penalty", "x"),
    ("repetition_penalty", -1), ("max_tokens", 0), ("stop", "ok" * 600), ("stop", [None]), ("stop_sequences", 5),
    ("top_logprobs", 21), ("top_logprobs", -1),
])
def test_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(RequestRejected) as info:
        validate_parameters({field: value})
    assert info.value.status_code == 400 and info.value.message.startswith(field)


def test_top_k_minus_one_is_no_limit() -> None:
    # vLLM's and SGLang's spelling (sglang-router writes it into every Responses request it forwards)
    validate_parameters({"top_k": -1})
    assert sampling_options({"top_k": -1}).top_k == 0


@pytest.mark.parametrize("value,message", [
    ([1], "must be an object"), ({"x": 1}, "keys must be token ids"), ({"-1": 1}, "outside the vocabulary"),
    ({"4096": 1}, "outside the vocabulary"), ({"5": 101}, "in [-100, 100]"), ({"5": "a"}, "finite number"),
])
def test_logit_bias_validation(value: object, message: str) -> None:
    with pytest.raises(RequestRejected) as info:
        validate_logit_bias(value, 4096)
    assert info.value.status_code == 400 and message in info.value.message
    validate_logit_bias({"0": -100, "4095": 100.0}, 4096)


def test_validation_accepts_edges() -> None:
    validate_parameters({"seed": 0, "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "frequency_penalty": -2,
                         "presence_penalty": 2, "repetition_penalty": 1.1, "stop": "x", "stop_sequences": ["a", "b"]})
    validate_parameters({"seed": 2**64 - 1, "max_tokens": None})


def test_fit_to_context() -> None:
    assert fit_to_context(10, 20, 100) == 20
    assert fit_to_context(90, 256, 100) == 10  # cut to what the prompt leaves, as the host does
    assert fit_to_context(90, 10, 100, strict=True) == 10
    with pytest.raises(RequestRejected, match="max_tokens may be at most 10"):  # --strict-max-tokens: vLLM's 400
        fit_to_context(90, 256, 100, strict=True)
    for strict in (False, True):  # a prompt alone over the context is a 400 either way
        with pytest.raises(RequestRejected, match="context is 100"):
            fit_to_context(100, 1, 100, strict=strict)
    assert fit_to_context(10**6, 5, None, strict=True) == 5


def test_the_routing_engine_cuts_max_tokens_unless_strict_and_set_by_the_client() -> None:
    from vllm_mlx_mtp_routing.host import asgi
    from vllm_mlx_mtp_routing.routing import RoutingEngine, RoutingSettings, ServingParts

    def fitted(strict: bool, body: dict | None, max_tokens: int = 256) -> int:
        router = RoutingEngine(SimpleNamespace(is_mllm=True), RoutingSettings())
        router.attach(ServingParts(tokenizer=None, context_tokens=100, tokens_per_media_item=0, admission=None, text=None,
                                   text_unavailable="test", strict_max_tokens=strict))
        options = {"max_tokens": max_tokens}
        token = asgi.CURRENT.set(asgi.RequestContext(body=body) if body is not None else None)
        try:
            router._fit_context(90, options)  # what admission projects and the engine runs with
        finally:
            asgi.CURRENT.reset(token)
        return options["max_tokens"]

    assert fitted(False, {"max_tokens": 256}) == 10
    assert fitted(True, {"max_tokens": 5}, max_tokens=5) == 5
    assert fitted(True, {}) == 10  # the host's default (or a /v1/responses body, unread here): cut
    for body in ({"max_tokens": 256}, {"max_completion_tokens": 256}, {"max_output_tokens": 256}, None):
        with pytest.raises(RequestRejected, match="max_tokens may be at most 10"):
            fitted(True, body)


def test_routing_engine_serves_or_forwards_every_public_host_method() -> None:
    from vllm_mlx.engine.batched import BatchedEngine

    from vllm_mlx_mtp_routing.routing import RoutingEngine

    public = {n for n, _ in inspect.getmembers(BatchedEngine) if not n.startswith("_")}
    served = {n for n in public if n in vars(RoutingEngine)}
    assert public - served <= RoutingEngine.FORWARDED, sorted(public - served - RoutingEngine.FORWARDED)
    assert {"abort_request", "get_stats", "clear_runtime_caches", "chat", "stream_chat", "stop"} <= served


def test_decorator_writes_are_deliberate() -> None:
    from vllm_mlx_mtp_routing.routing import RoutingEngine, RoutingSettings

    class Host:
        preserve_native_tool_format = False
        scheduler = "host's"

    host = Host()
    router = RoutingEngine(host, RoutingSettings())
    router.preserve_native_tool_format = True  # the host sets this on whatever engine it holds
    assert host.preserve_native_tool_format is True
    router.disabled_reason = "mine"  # the decorator's own attribute stays on it
    assert "disabled_reason" not in vars(host)
    router.scheduler = "replaced"  # the host engine's own attribute: its owner gets the write
    assert host.scheduler == "replaced"
    with pytest.raises(AttributeError, match="text_engin"):
        router.text_engin = "a typo"  # neither owns it: no new state on the host engine
    assert not hasattr(host, "text_engin")


def test_undecodable_inline_images_are_400() -> None:
    from support.server import png_data_url
    from vllm_mlx_mtp_routing.routing.request_validation import validate_inline_images

    good = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url((1, 2, 3))}}]}
    validate_inline_images([good])
    for url in ("data:image/png;base64,@@@notbase64", "data:image/png;base64," + "QUJD" * 10):
        bad = {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}
        with pytest.raises(RequestRejected, match=r"messages\[0\]\.content\[1\]"):
            validate_inline_images([bad])
    block = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}]}
    with pytest.raises(RequestRejected):
        validate_inline_images([block])


def test_image_references_the_host_cannot_read_are_400() -> None:
    """vllm-mlx 0.6.0 reads http(s) URLs, data:image URLs and long raw base64; anything else (a path, junk, an
    Anthropic url source that is no URL) was a 500 from its media path."""
    from support.server import png_data_url
    from vllm_mlx_mtp_routing.routing.request_validation import validate_inline_images

    def chat(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]

    for url in ("https://example.com/a.png", "http://x/y.jpg", png_data_url((1, 2, 3)), png_data_url((1, 2, 3)).split(",")[1]):
        validate_inline_images(chat(url))
    for url in ("\u00a8", "/tmp/picture.png", "ftp://example.com/a.png", "file:///etc/passwd", "Q" * 120):
        with pytest.raises(RequestRejected, match=r"messages\[0\]\.content\[0\]"):
            validate_inline_images(chat(url))
    anthropic = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "\u00a8"}}]}]
    with pytest.raises(RequestRejected, match="http"):
        validate_inline_images(anthropic)
