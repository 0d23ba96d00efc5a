"""What the routing engine needs from the host's BatchedEngine (vllm-mlx 0.6.0 internals, read here only)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm_mlx.api.tool_calling import convert_tools_for_template
from vllm_mlx.api.utils import clean_output_text
from vllm_mlx.engine.base import GenerationOutput

logger = logging.getLogger("vllm_mlx_mtp_routing.routing")

__all__ = [
    "GenerationOutput", "attach_logit_bias", "clean_output_text", "disable_mllm_mtp", "host_mtp_drafter", "load_image",
    "media_references", "processor", "processor_inputs", "render_chat_prompt",
    "scheduler_setting", "specprefill_outcome", "tokens_per_media_item",
]


def specprefill_outcome(fields: dict | None) -> Any:
    """The host's per-response SpecPrefill diagnostics object (``GenerationOutput.specprefill_outcome``,
    shown in the response's ``generation_metadata``) from the text path's fields; None for None."""
    if fields is None:
        return None
    from vllm_mlx.mllm_specprefill import SpecPrefillOutcome

    return SpecPrefillOutcome(**fields)


def scheduler_setting(engine: Any, name: str, default: Any) -> Any:
    config = getattr(engine, "_scheduler_config", None)
    return getattr(config, name, default) if config is not None else default


def disable_mllm_mtp(engine: Any) -> bool:
    """Keep the host from injecting MTP into the mlx-vlm model (its injected ``__call__`` drops image
    embeddings and M-RoPE positions). The MLLM scheduler then runs plain decoding; MTP runs on the
    text path. Returns whether MTP had been enabled."""
    config = getattr(engine, "_scheduler_config", None)
    if config is None or not getattr(config, "enable_mtp", False):
        return False
    engine._scheduler_config = dataclasses.replace(config, enable_mtp=False)
    return True


def host_mtp_drafter(engine: Any) -> tuple[str | None, Any]:
    """The host's ``--mllm-draft-model PATH --mllm-draft-kind mtp``: (PATH, the drafter its mlx-vlm model
    loaded, or None before load). (None, None) without one. vllm-mlx 0.6.0 keeps them in BatchedEngine's
    ``_mllm_draft_model`` / ``_mllm_draft_kind`` and ``MLXMultimodalLM._draft_model``."""
    path = getattr(engine, "_mllm_draft_model", None)
    if not path or getattr(engine, "_mllm_draft_kind", None) != "mtp":
        return None, None
    return str(path), getattr(getattr(engine, "_mllm_instance", None), "_draft_model", None)


def attach_logit_bias(options: dict[str, Any], logit_bias: Any) -> None:
    """The host's logit-bias processor (vllm-mlx 0.6.0 ``server._attach_logit_bias_processor``, which its
    chat endpoint calls and its completions endpoint does not) added to ``options``; 400 for a bad id."""
    from vllm_mlx import server

    if isinstance(logit_bias, dict):
        server._attach_logit_bias_processor(options, logit_bias)


def render_chat_prompt(engine: Any, messages: list[dict[str, Any]], options: dict[str, Any], images: int = 0) -> str:
    """The exact prompt the host would render for a chat, so both paths see the same tokens; with ``images``, its
    ``_apply_chat_template`` turns each ``image_url`` part into the processor's image placeholder."""
    tools = options.get("tools")
    return engine._apply_chat_template(
        messages,
        convert_tools_for_template(tools) if tools else None,
        num_images=images,
        num_audios=0,
        chat_template_kwargs=dict(options.get("chat_template_kwargs") or {}),
        enable_thinking=options.get("enable_thinking"),
    )


def media_references(messages: list[dict[str, Any]]) -> tuple[list[Any], list[Any], list[Any]]:
    """(images, videos, audios) of a chat as the host extracts them (``api.utils.extract_multimodal_content``)."""
    from vllm_mlx.api.utils import extract_multimodal_content

    _, images, videos, audios = extract_multimodal_content(messages)
    return list(images), list(videos), list(audios)


def load_image(reference: Any) -> str:
    """A local file of one image reference (a data: URL or an http(s) URL), fetched as the host fetches it
    (``models.mllm.process_image_input``); ValueError for what it refuses."""
    from vllm_mlx.models.mllm import process_image_input

    return str(process_image_input(reference))


def processor(engine: Any) -> Any:
    """The host's mlx-vlm processor (BatchedEngine ``_processor``); None before the model loads."""
    return getattr(engine, "_processor", None)


def processor_inputs(processor: Any, images: list[str], prompt: str, image_token_id: int) -> dict[str, Any]:
    """The processor's inputs for a prompt and its images (mlx-vlm ``prepare_inputs``, as the host's media path calls
    it): ``input_ids``, ``pixel_values``, ``image_grid_thw``."""
    from mlx_vlm.utils import prepare_inputs

    return dict(prepare_inputs(processor, images=images, prompts=prompt, image_token_index=image_token_id))


# A media item is projected at the processor's own bound, capped: an uncapped Qwen bound (16M pixels,
# 16k tokens) would make every image request look like a long prompt to admission.
MAX_TOKENS_PER_MEDIA_ITEM = 4096


def tokens_per_media_item(engine: Any) -> int:
    """Upper bound of the tokens one image expands to, from the host processor's image settings."""
    image_processor = getattr(getattr(engine, "_processor", None), "image_processor", None)
    size = getattr(image_processor, "size", None) or {}
    longest = (size.get("longest_edge") if isinstance(size, dict) else None) or getattr(image_processor, "max_pixels", None)
    patch = int(getattr(image_processor, "patch_size", 14) or 14)
    merge = int(getattr(image_processor, "merge_size", 2) or 2)
    if not longest:
        return MAX_TOKENS_PER_MEDIA_ITEM
    return max(1, min(MAX_TOKENS_PER_MEDIA_ITEM, int(longest) // (patch * merge) ** 2))


# The host ends a stream that shows no output for its request timeout (vllm-mlx 0.6.0
# server._disconnect_guard, `--timeout`, default 300 s, per request the body's `timeout`).
TIMEOUT_MARGIN_S = 5.0


def request_timeout(body: dict[str, Any]) -> float | None:
    """The host's inactivity timeout for a request: the body's ``timeout``, else ``--timeout`` (server internals:
    ``_default_timeout``)."""
    timeout = body.get("timeout") if isinstance(body.get("timeout"), (int, float)) else None
    if not timeout:
        from vllm_mlx import server

        timeout = getattr(server, "_default_timeout", None)
    return float(timeout) if timeout else None


def request_wait_limit(body: dict[str, Any]) -> float | None:
    """How long a request may wait for admission before the host's own inactivity timeout would end
    its stream."""
    timeout = request_timeout(body)
    if timeout is None:
        return None
    return max(timeout - TIMEOUT_MARGIN_S, timeout / 2)


def host_cache_budget_bytes(cache_memory_mb: int | None, cache_memory_percent: float) -> int:
    """The prefix-cache byte budget as the host computes it from --cache-memory-mb /
    --cache-memory-percent (vllm-mlx 0.6.0 ``memory_cache.MemoryCacheConfig.compute_memory_limit``:
    MB given, or that fraction of the available RAM, at least its own minimum)."""
    from vllm_mlx.memory_cache import MemoryCacheConfig

    if cache_memory_mb == 0:
        return 0
    return int(MemoryCacheConfig(max_memory_mb=cache_memory_mb, max_memory_percent=cache_memory_percent).compute_memory_limit())


def warm_prompt_prefixes(path: str, tokenizer: Any) -> frozenset[str]:
    """The prompt strings the host's --warm-prompts start-up will send (vllm-mlx 0.6.0
    ``prompt_warmup``: its private ``_build_strict_prefix_string`` per entry), so the text path can
    keep their snapshots as system prefixes. A file the host cannot read gives none (the host logs it)."""
    from vllm_mlx import prompt_warmup

    try:
        entries = prompt_warmup.load_warmup_file(path)
    except Exception:
        return frozenset()
    prefixes = (prompt_warmup._build_strict_prefix_string(tokenizer, messages) for messages in entries)
    return frozenset(p for p in prefixes if p)
