"""Builds the routing engine's parts from the loaded model and the config: the text model, its MTP decode, the
prefill budget, the prefix cache, SpecPrefill, the text engine, admission and the prompt preparer, each given
what it needs when it is constructed.

Without a text path for this model (``TextModelUnavailable``) only what the host's path needs is built.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import admission
from .config import PluginConfig, RoutingSettings, SpecPrefillConfig
from .host import engine_access, logprobs_response, specprefill_flags, usage
from .model.checkpoint_layouts import NO_MTP_HINT, MTPUnavailable
from .model.media_forward import VisionParts
from .model.text_model import TextModelBundle, TextModelUnavailable, build_text_model
from .model.weights_fingerprint import fingerprint
from .plugin_api.hookspecs import ModelInfo
from .prefix_cache import settings as prefix_settings
from .prefix_cache.cache import PrefixCache
from .prefix_cache.disk_tier import DiskTier
from .prefix_cache.metrics import register_metrics as register_prefix_cache_metrics
from .routing.parts import ServingParts, TextPath
from .routing.prompt_preparation import PromptPreparer
from .specprefill import SpecPrefill
from .specprefill.scoring import attention_layers
from .text_engine import calibration_file, warmup
from .text_engine.engine import TextEngine
from .text_engine.spec.mtp import MTPDecode

logger = logging.getLogger("vllm_mlx_mtp_routing")


def assemble(info: ModelInfo, host_engine: Any, settings: RoutingSettings, config: PluginConfig) -> ServingParts:
    """Everything the routing engine serves with; raises where a flag cannot work with this model (start-up fails)."""
    tokenizer = info.tokenizer
    media_tokens = engine_access.tokens_per_media_item(host_engine)
    context = context_tokens(info.config)
    drafter_path, drafter = engine_access.host_mtp_drafter(host_engine)
    try:
        bundle = build_text_model(
            info.model, Path(info.model_path), info.config, enable_mtp=settings.enable_mtp,
            drafter=drafter, drafter_path=Path(drafter_path) if drafter_path else None,
        )
    except TextModelUnavailable as exc:
        controller = admission_controller(config.admission, info.config, settings)
        return ServingParts(
            tokenizer, context, media_tokens, controller, text=None, text_unavailable=str(exc),
            strict_max_tokens=config.strict_max_tokens,
        )
    mtp = mtp_decode(bundle, settings, config, Path(info.model_path).name)
    vocab = int((info.config.get("text_config") or info.config).get("vocab_size") or 1024)
    weights = functools.cache(lambda: fingerprint(bundle.model))  # the calibration file's key and the disk tier's folder
    budget = calibration_file.calibrated(
        bundle.model, max_chunk=settings.prefill_step_size, ratio=config.prefill_stall_ratio, vocab_size=vocab,
        path=config.calibration_file, remeasure=config.recalibrate,
        weights=weights() if config.calibration_file is not None else None,
    )
    cache = prefix_cache(bundle.model, config, with_head=bundle.mtp is not None, weights=weights)
    warm_prefixes: frozenset[str] = frozenset()
    if cache is not None and config.warm_prompts:
        warm_prefixes = engine_access.warm_prompt_prefixes(config.warm_prompts, tokenizer)
    vision, media_off = vision_parts(info)
    engine = TextEngine(
        bundle.model,
        tokenizer,
        max_num_seqs=settings.max_num_seqs,
        prefill_step_size=settings.prefill_step_size,
        eos_token_ids=eos_token_ids(Path(info.model_path), info.config, tokenizer),
        decode=mtp if isinstance(mtp, MTPDecode) else None,
        prefix_cache=cache,
        specprefill=specprefill(config.specprefill, host_engine, tokenizer) if config.specprefill is not None else None,
        vision=vision,
    )
    budget.apply(engine.scheduler)
    warm_up(engine, config.text_warmup)
    # Built once the text path knows whether MTP loaded: its projection comes from the engine.
    controller = admission_controller(
        config.admission, info.config, settings, text_engine=engine,
        cache_bytes=(lambda: cache.nbytes) if cache is not None else None,  # the cache's bytes are used memory
    )
    logprobs_response.install()
    prompts = PromptPreparer.create(tokenizer, engine_access.processor(host_engine) if vision is not None else None)
    text = TextPath(engine, budget, mtp, prompts, warm_prefixes, vocab, vision, media_off)
    return ServingParts(tokenizer, context, media_tokens, controller, text=text, strict_max_tokens=config.strict_max_tokens)


def eos_token_ids(model_path: Path, config: dict[str, Any], tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json, the config and the tokenizer: the model stops on any of them."""
    ids: list[int] = []
    sources: list[Any] = [config.get("eos_token_id"), config.get("text_config", {}).get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)]
    gen_config = model_path / "generation_config.json"
    if gen_config.is_file():
        sources.insert(0, json.loads(gen_config.read_text()).get("eos_token_id"))
    for value in sources:
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def vision_parts(info: ModelInfo) -> tuple[VisionParts | None, str | None]:
    """The VLM's parts that media rows need, or why media requests stay on the host's path."""
    vlm = info.model
    if getattr(vlm, "vision_tower", None) is None or not callable(getattr(getattr(vlm, "language_model", None), "get_rope_index", None)):
        return None, "the model has no vision tower with M-RoPE positions"
    vision = VisionParts(vlm, info.config)
    if vision.image_token_id < 0:
        return None, "the model's config names no image token"
    logger.info("Media requests (images) are served as rows of the text batch: vision tower and M-RoPE from the VLM")
    return vision, None


def context_tokens(config: dict[str, Any]) -> int | None:
    """The model's context length (text_config first: a VLM's top level may describe the vision tower)."""
    for source in (config.get("text_config") or {}, config):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def mtp_decode(
    bundle: TextModelBundle, settings: RoutingSettings, config: PluginConfig, model_name: str
) -> MTPDecode | MTPUnavailable | None:
    """The text path's MTP decode when the head loaded; its status when MTP was asked for and did not load."""
    if bundle.mtp is not None:
        decode = MTPDecode(
            bundle.mtp,
            k=settings.mtp_num_draft_tokens,
            adaptive=config.mtp_schedule == "adaptive",
            choose_count=True,
            max_batch_size=config.mtp_max_batch_size,
            prompt_pairs=config.mtp_prompt_pairs,
        )
        logger.info(
            "mtp-routing: MTP speculative decoding on the text path, k=%d%s, per-row acceptance, schedule %s, max batch %s, "
            "head over the prompt's last %s positions",
            settings.mtp_num_draft_tokens,
            " (or fewer, where that pays more)" if settings.mtp_num_draft_tokens > 1 and config.mtp_schedule == "adaptive"
            else "",
            config.mtp_schedule, config.mtp_max_batch_size or "unlimited",
            config.mtp_prompt_pairs or "all",
        )
        return decode
    if settings.enable_mtp:
        logger.warning(
            "mtp-routing: MTP requested, but %s serves without MTP: %s. To get MTP, %s",
            model_name, bundle.mtp_unavailable_reason, NO_MTP_HINT,
        )
        return MTPUnavailable(str(bundle.mtp_unavailable_reason))
    return None


def prefix_cache(model: Any, config: PluginConfig, *, with_head: bool, weights: Callable[[], str]) -> PrefixCache | None:
    settings = config.prefix_cache or prefix_settings.from_args(None)
    if not settings.enabled or settings.budget_bytes <= 0:
        logger.info("mtp-routing: text-path prefix cache off (%s)", "--disable-prefix-cache" if not settings.enabled else "budget 0")
        return None
    disk = None
    if settings.ssd_dir:
        disk = DiskTier(Path(settings.ssd_dir), settings.ssd_budget_bytes, weights())
        logger.info("mtp-routing: text-path prefix cache spills to %s (up to %.1f GB)", disk.dir, settings.ssd_budget_bytes / 1e9)
    cache = PrefixCache(model, settings.budget_bytes, with_head=with_head, disk=disk)
    usage.install()
    register_prefix_cache_metrics(cache)
    logger.info(
        "mtp-routing: text-path prefix cache on, budget %.0f MiB (system prompts, conversations, tool turns; snapshots of "
        "attention KV, gated-delta state%s)", settings.budget_bytes / 2**20, " and the MTP head" if cache.with_head else "",
    )
    return cache


def specprefill(config: SpecPrefillConfig, host_engine: Any, tokenizer: Any) -> SpecPrefill:
    specprefill_flags.check_loaded_tokenizer(config.draft_path, tokenizer)
    draft = specprefill_flags.load_draft(host_engine, config.draft_path)
    attention_layers(draft)  # a draft whose queries cannot be read fails start-up, not a request
    settings = config.settings
    logger.info(
        "mtp-routing: SpecPrefill on the text path: draft %s, prompts over %d tokens (after a prefix-cache hit) keep %.0f%% "
        "(%.0f%% evenly spaced) in %d-token chunks, scored between decode steps",
        config.draft_path, settings.threshold, settings.keep_pct * 100, settings.backbone_pct * 100, settings.chunk_tokens,
    )
    return SpecPrefill(draft, settings)


def warm_up(engine: TextEngine, mode: str) -> None:
    if not warmup.enabled(mode):
        return
    try:
        done = engine.warm_up()
    except Exception:  # the first requests pay the compiles instead; a step that cannot run fails them as it did here
        logger.exception("mtp-routing: the text path's start-up warm-up failed; serving without it")
        return
    verify = f" and a {done.draft_tokens}-draft MTP verify at {_sizes(done.verify_batch_sizes)}" if done.verify_batch_sizes else ""
    logger.info(
        "mtp-routing: text decode warmed up at batch sizes %s (a plain step%s) in %.1f s (--text-warmup %s)",
        _sizes(done.batch_sizes), verify, done.seconds, mode,
    )


def _sizes(sizes: list[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 and sizes == list(range(sizes[0], sizes[-1] + 1)) else ",".join(map(str, sizes))


def admission_controller(
    settings: admission.AdmissionSettings | None, model_config: dict[str, Any], routing: RoutingSettings, *,
    text_engine: TextEngine | None = None, cache_bytes: Callable[[], int] | None = None,
) -> admission.AdmissionController | None:
    if settings is None:
        return None
    try:
        admission.check_budget_after_load(settings, mx.get_active_memory())
    except Exception as exc:  # the flag cannot work with this model on this device: say so, then fail start-up
        logger.error("mtp-routing: %s", exc)
        raise
    # The mlx-vlm path: its own caches, and with --enable-mtp moved to the text path, no MTP head.
    memory_model = admission.MemoryModel.from_model_config(
        model_config, prefill_step_size=routing.prefill_step_size, include_mtp=False
    )
    # The text path states what it allocates (its KV pool, the MTP head only if it loaded, k drafts).
    path_models = {"text": text_engine.memory_model()} if text_engine is not None else {}
    controller = admission.AdmissionController.from_settings(
        settings, memory_model=memory_model, path_models=path_models, cache_bytes=cache_bytes
    )
    admission.register_metrics(controller)
    logger.info(
        "mtp-routing admission: policy=%s budget=%.2f GiB (device %.2f GiB from %s, headroom %.2f GiB), max running %d, max queue %d",
        settings.policy, settings.budget_bytes / 2**30, settings.device_bytes / 2**30, settings.device_source,
        settings.headroom_bytes / 2**30, settings.max_running, settings.max_queue,
    )
    return controller
