"""A request's options: what the pre-generation hook carries past the host's request models, what the text
path samples with, and what it cannot serve as the host would."""

from __future__ import annotations

from typing import Any

from ..host import engine_access
from ..plugin_api.errors import RequestRejected
from ..plugin_api.hookspecs import GenerationRequest
from ..text_engine.sampling import SamplingOptions
from .request_validation import (
    body_sampling_options,
    validate_inline_images,
    validate_logit_bias,
    validate_parameters,
)

PRIORITY_HEADER = "x-request-priority"
# Options the plugin's pre-generation hook adds; the host's engine never sees them.
PLUGIN_OPTIONS = ("priority", "seed", "frequency_penalty", "logprobs", "top_logprobs", "cache_salt")


def amend(request: GenerationRequest, *, vocab_size: int | None) -> None:
    """Carry what the host's request models drop: the priority header, the OpenAI ``seed``,
    ``frequency_penalty`` and ``logprobs`` fields, ``logit_bias`` on completions, Anthropic's ``stop_sequences``
    and vLLM's ``cache_salt`` (the prefix-cache space of the request)."""
    value = request.headers.get(PRIORITY_HEADER)
    if value is not None:
        try:
            request.options["priority"] = int(value)
        except ValueError:
            raise RequestRejected(400, f"X-Request-Priority must be an integer, got {value!r}") from None
    validate_parameters(request.body, request.options)
    validate_logit_bias(request.body.get("logit_bias"), vocab_size)
    validate_inline_images(request.body.get("messages") if request.body else request.messages)
    seed = request.body.get("seed")
    if seed is not None:
        request.options["seed"] = int(seed)
    salt = request.body.get("cache_salt")
    if salt is not None:
        request.options["cache_salt"] = salt
    stops = request.body.get("stop_sequences")  # Anthropic's stop list: the host drops it (vllm-mlx 0.6.0)
    if stops and not request.options.get("stop"):
        request.options["stop"] = [stops] if isinstance(stops, str) else list(stops)
    request.options.update(body_sampling_options(request.method, request.body))
    if request.method in ("generate", "stream_generate") and request.body.get("logit_bias"):
        engine_access.attach_logit_bias(request.options, request.body["logit_bias"])


def split_plugin_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Take the plugin-only options out of the host's kwargs (in place); return them and the priority."""
    plugin = {k: kwargs.pop(k) for k in PLUGIN_OPTIONS if k in kwargs}
    return plugin, int(plugin.get("priority", 0))


def text_path_gap(options: dict[str, Any], *, text_mtp: bool = False) -> str | None:
    """Why the text path cannot serve these options exactly as the host would (None: it can).

    `text_mtp`: the text path drafts with an MTP head (the host's own drafter when one is
    configured), so a request asking for the host's drafter (`mllm_draft`) is served there."""
    if options.get("mllm_draft") and not text_mtp:
        return "a host drafter was requested and the text path has no MTP head"
    return None


def sampling_options(options: dict[str, Any]) -> SamplingOptions:
    stop = options.get("stop") or []
    top_p = options.get("top_p")
    return SamplingOptions(
        max_tokens=int(options.get("max_tokens") or 256),
        temperature=float(options.get("temperature") or 0.0),
        top_p=float(top_p if top_p is not None else 1.0),
        top_k=max(0, int(options.get("top_k") or 0)),  # -1: no limit (vLLM, SGLang)
        min_p=float(options.get("min_p") or 0.0),
        seed=options.get("seed"),
        stop=[stop] if isinstance(stop, str) else list(stop),
        logits_processors=list(options.get("logits_processors") or ()),
        presence_penalty=float(options.get("presence_penalty") or 0.0),
        frequency_penalty=float(options.get("frequency_penalty") or 0.0),
        repetition_penalty=float(options.get("repetition_penalty") or 1.0),
        logprobs=bool(options.get("logprobs")),
        top_logprobs=int(options.get("top_logprobs") or 0),
    )
