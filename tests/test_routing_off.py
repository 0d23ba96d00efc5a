"""Why routing is off, said once at WARNING with the fix and repeated by the status: a model served as text only, and
a checkpoint the text path cannot serve (the e2e module covers a server without --continuous-batching)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_mlx_mtp_routing.plugin import MTPRoutingPlugin
from vllm_mlx_mtp_routing.plugin_api.hookspecs import EngineContext
from vllm_mlx_mtp_routing.routing import RoutingEngine, RoutingSettings, ServingParts


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("vllm_mlx_mtp_routing") and r.levelno >= logging.WARNING]


def test_a_model_served_as_text_only_is_left_alone_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    plugin = MTPRoutingPlugin()
    engine = SimpleNamespace(is_mllm=False, model_name="some-llm")
    context = EngineContext(kind="batched", site="load_model", options={})
    with caplog.at_level(logging.INFO):
        assert plugin.vllm_mlx_wrap_engine(engine, context) is None
        assert plugin.vllm_mlx_wrap_engine(engine, context) is None  # another engine of the same server: no repeat
    [warning] = ours(caplog)
    assert "routing is off: some-llm is served as a text-only model" in warning.getMessage()
    assert warning.getMessage().endswith("To route: serve a Qwen3.5 VLM checkpoint (--mllm where the host does not detect one)")
    routing = plugin.vllm_mlx_stats(engine)["routing"]
    assert routing["enabled"] is False and "some-llm" in routing["reason"] and routing["fix"].startswith("serve a Qwen3.5")


def test_disabled_by_flag_is_info_and_has_no_fix(caplog: pytest.LogCaptureFixture) -> None:
    plugin = MTPRoutingPlugin()
    engine = SimpleNamespace(is_mllm=True)
    context = EngineContext(kind="batched", site="load_model", options={}, args=SimpleNamespace(mtp_routing_disable=True))
    with caplog.at_level(logging.INFO):
        assert plugin.vllm_mlx_wrap_engine(engine, context) is None
    assert not ours(caplog) and "routing is off: disabled by --mtp-routing-disable" in caplog.text
    assert plugin.vllm_mlx_stats(engine)["routing"] == {"enabled": False, "reason": "disabled by --mtp-routing-disable"}


def test_a_checkpoint_without_a_text_path_warns_and_the_status_says_why(caplog: pytest.LogCaptureFixture) -> None:
    router = RoutingEngine(SimpleNamespace(is_mllm=True), RoutingSettings())
    reason = "model_type 'gemma3' is not a Qwen3.5 hybrid model"
    with caplog.at_level(logging.INFO):
        router.attach(ServingParts(tokenizer=None, context_tokens=None, tokens_per_media_item=0, admission=None, text=None,
                                   text_unavailable=reason))
    [warning] = ours(caplog)
    assert f"routing is off: no text path for this model: {reason}" in warning.getMessage()
    assert "To route: serve a Qwen3.5 checkpoint" in warning.getMessage()
    routing = router.routing_stats()["routing"]
    assert routing == {"enabled": False, "reason": f"no text path for this model: {reason}", "fix": routing["fix"],
                       "text": 0, "media": 0, "fallback": 0}
