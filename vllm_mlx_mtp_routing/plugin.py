"""The ``mtp-routing`` plugin: hook wiring only; each capability lives in its own module."""

from __future__ import annotations

import argparse
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__, admission, gc_pauses
from .prefix_cache import settings as prefix_settings
from .plugin_api.engine_decorator import find_decorator
from .plugin_api.errors import RequestRejected
from .flag_types import count_or_all, int_at_least, non_negative
from .text_engine.spec.proposer import DEFAULT_PROMPT_PAIRS
from .text_engine import calibration_file, warmup
from .text_engine.prefill_budget import DEFAULT_RATIO as DEFAULT_STALL_RATIO
from .plugin_api.hookspecs import EngineContext, GenerationRequest, ModelInfo, hookimpl
from .request_validation import body_sampling_options, validate_inline_images, validate_logit_bias, validate_parameters
from .host import engine_access, specprefill_flags
from .routing import RoutingEngine, RoutingSettings
from .model.weights_fingerprint import fingerprint

logger = logging.getLogger("vllm_mlx_mtp_routing")

PRIORITY_HEADER = "x-request-priority"


@dataclass
class _State:
    """Per process: one ``vllm-mlx serve`` loads this plugin once."""

    admission: admission.AdmissionSettings | None = None
    routing_active: bool = False
    mtp_schedule: str = "adaptive"
    mtp_max_batch_size: int | None = None
    mtp_prompt_pairs: int | None = DEFAULT_PROMPT_PAIRS
    prefill_stall_ratio: float = DEFAULT_STALL_RATIO
    calibration_file: Path | None = None  # --prefill-calibration-file (None: 'none')
    recalibrate: bool = False
    text_warmup: str = "auto"  # --text-warmup
    prefix_cache: prefix_settings.PrefixCacheSettings | None = None
    warm_prompts: str | None = None
    vocab_size: int | None = None  # the loaded model's, for logit_bias ids
    specprefill: tuple[Any, str] | None = None  # (SpecPrefillSettings, draft path) with --specprefill


STATE = _State()


@hookimpl
def vllm_mlx_add_cli_args(group: Any) -> None:
    group.add_argument(
        "--mtp-routing-disable",
        action="store_true",
        help="Load the plugin but leave the engine as the host built it (every request on the host's path).",
    )
    group.add_argument(
        "--mtp-schedule",
        choices=("adaptive", "always"),
        default="adaptive",
        help="Text-path MTP with --enable-mtp: 'adaptive' (default) drafts per step only where measured "
        "throughput says it pays and pauses rows with low acceptance; 'always' drafts every step for every row.",
    )
    group.add_argument(
        "--mtp-max-batch-size",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="Text-path MTP drafts only while the batch has at most N rows (default: no limit).",
    )
    group.add_argument(
        "--mtp-prompt-pairs",
        type=count_or_all,
        default=DEFAULT_PROMPT_PAIRS,
        metavar="N|all",
        help=f"Text-path MTP: the MTP head takes the prompt's last N positions in the prefill (default "
        f"{DEFAULT_PROMPT_PAIRS}); 'all': every position, which costs a long prompt's prefill the model's last "
        "layer and the head at every position for a little more acceptance.",
    )
    group.add_argument(
        "--prefill-stall-ratio",
        type=non_negative,
        default=DEFAULT_STALL_RATIO,
        metavar="R",
        help="Text path: a step's prefill chunk is sized at start from measured throughput to take at most R "
        f"decode steps (default {DEFAULT_STALL_RATIO:g}), so running streams and /health keep their cadence while a "
        "long prompt prefills; capped by --prefill-step-size. 0: chunks of --prefill-step-size tokens.",
    )
    group.add_argument(
        "--prefill-calibration-file",
        default=None,
        metavar="PATH|none",
        help="Text path: where the chunk measured at start is kept and reused by later starts with the same model "
        "weights, device, library versions and prefill flags (default $VLLM_MLX_PREFILL_CALIBRATION_FILE, else "
        "~/.cache/vllm-mlx-mtp-routing/prefill-calibration.json); 'none': measure at every start, keep nothing.",
    )
    group.add_argument(
        "--prefill-recalibrate",
        action="store_true",
        help="Text path: measure the prefill chunk at this start even if --prefill-calibration-file has one, and "
        "replace it there (after a change of load or hardware the stored one no longer describes).",
    )
    group.add_argument(
        "--text-warmup",
        choices=warmup.MODES,
        default="auto",
        help="Text path: at start, step throwaway rows through the decode at each batch size 1..min(--max-num-seqs, "
        f"{warmup.MAX_BATCH}) (a plain step, and with MTP a verify), then a longer row joins and leaves, so that no request "
        "pays a batch size's first-use kernel compiles and plans (seconds per size on an H100). 'auto' (default): on for a CUDA GPU, off on the CPU "
        "and Metal.",
    )
    admission.add_arguments(group)


@hookimpl
def vllm_mlx_validate_args(args: argparse.Namespace) -> None:
    STATE.admission = admission.validate(args)
    STATE.mtp_schedule = args.mtp_schedule
    STATE.mtp_max_batch_size = args.mtp_max_batch_size
    STATE.mtp_prompt_pairs = getattr(args, "mtp_prompt_pairs", DEFAULT_PROMPT_PAIRS)
    STATE.prefill_stall_ratio = float(getattr(args, "prefill_stall_ratio", DEFAULT_STALL_RATIO))
    STATE.calibration_file = calibration_file.from_flag(getattr(args, "prefill_calibration_file", None))
    STATE.recalibrate = bool(getattr(args, "prefill_recalibrate", False))
    STATE.text_warmup = getattr(args, "text_warmup", "auto")
    STATE.prefix_cache = prefix_settings.from_args(args)
    STATE.warm_prompts = getattr(args, "warm_prompts", None)
    STATE.specprefill = specprefill_flags.from_args(args)


@hookimpl
def vllm_mlx_wrap_engine(engine: Any, context: EngineContext) -> Any:
    args = context.args
    if args is not None and getattr(args, "mtp_routing_disable", False):
        logger.info("mtp-routing: routing disabled by --mtp-routing-disable")
        return None
    if context.kind != "batched":
        logger.info("mtp-routing: routing needs --continuous-batching; the engine is left as the host built it")
        return None
    if not getattr(engine, "is_mllm", False):
        logger.info("mtp-routing: %s is not served as a VLM (--mllm); nothing to route", getattr(engine, "model_name", "model"))
        return None
    drafter_path, _ = engine_access.host_mtp_drafter(engine)
    if drafter_path is not None:
        logger.info("mtp-routing: the text path drafts with the host's MTP drafter %s (--mllm-draft-model)", drafter_path)
    settings = RoutingSettings(
        # A host MTP drafter is a request for speculative decoding: the text path uses the same one.
        enable_mtp=bool(engine_access.scheduler_setting(engine, "enable_mtp", False)) or drafter_path is not None,
        mtp_num_draft_tokens=int(engine_access.scheduler_setting(engine, "mtp_num_draft_tokens", 1) or 1),
        max_num_seqs=int(engine_access.scheduler_setting(engine, "max_num_seqs", 16)),
        prefill_step_size=int(engine_access.scheduler_setting(engine, "prefill_step_size", 2048)),
    )
    STATE.routing_active = True
    return RoutingEngine(engine, settings)


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


def context_tokens(config: dict[str, Any]) -> int | None:
    """The model's context length (text_config first: a VLM's top level may describe the vision tower)."""
    for source in (config.get("text_config") or {}, config):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def _admission_controller(info: ModelInfo, router: RoutingEngine, text_engine: Any = None) -> Any:
    import mlx.core as mx

    settings = STATE.admission
    if settings is None:
        return None
    try:
        admission.check_budget_after_load(settings, mx.get_active_memory())
    except Exception as exc:  # the flag cannot work with this model on this device: say so, then fail start-up
        logger.error("mtp-routing: %s", exc)
        raise
    # The mlx-vlm path: its own caches, and with --enable-mtp moved to the text path, no MTP head.
    memory_model = admission.MemoryModel.from_model_config(
        info.config, prefill_step_size=router.settings.prefill_step_size, include_mtp=False
    )
    # The text path states what it allocates (its KV pool, the MTP head only if it loaded, k drafts).
    path_models = {"text": text_engine.memory_model()} if text_engine is not None else {}
    controller = admission.AdmissionController.from_settings(settings, memory_model=memory_model, path_models=path_models)
    admission.register_metrics(controller)
    logger.info(
        "mtp-routing admission: policy=%s budget=%.2f GiB (device %.2f GiB from %s, headroom %.2f GiB), max running %d, max queue %d",
        settings.policy, settings.budget_bytes / 2**30, settings.device_bytes / 2**30, settings.device_source,
        settings.headroom_bytes / 2**30, settings.max_running, settings.max_queue,
    )
    return controller


@hookimpl
def vllm_mlx_model_loaded(engine: Any, info: ModelInfo) -> Any:
    router = find_decorator(engine, RoutingEngine)
    if router is None:
        return None
    from .model.checkpoint_layouts import NO_MTP_HINT, MTPUnavailable
    from .text_engine.engine import TextEngine
    from .model.text_model import TextModelUnavailable, build_text_model

    router.tokenizer_for_text = info.tokenizer
    router.tokens_per_media_item = engine_access.tokens_per_media_item(router.wrapped)
    router.context_tokens = context_tokens(info.config)
    drafter_path, drafter = engine_access.host_mtp_drafter(router.wrapped)
    try:
        bundle = build_text_model(
            info.model, Path(info.model_path), info.config, enable_mtp=router.settings.enable_mtp,
            drafter=drafter, drafter_path=Path(drafter_path) if drafter_path else None,
        )
    except TextModelUnavailable as exc:
        router.admission = _admission_controller(info, router)
        router.disable_text_path(str(exc))
        return None
    if bundle.mtp is not None:
        from .text_engine.spec.mtp import MTPDecode

        router.mtp_decode = MTPDecode(
            bundle.mtp,
            k=router.settings.mtp_num_draft_tokens,
            adaptive=STATE.mtp_schedule == "adaptive",
            max_batch_size=STATE.mtp_max_batch_size,
            prompt_pairs=STATE.mtp_prompt_pairs,
        )
        logger.info(
            "mtp-routing: MTP speculative decoding on the text path, k=%d, per-row acceptance, schedule %s, max batch %s, "
            "head over the prompt's last %s positions",
            router.settings.mtp_num_draft_tokens, STATE.mtp_schedule, STATE.mtp_max_batch_size or "unlimited",
            STATE.mtp_prompt_pairs or "all",
        )
    elif router.settings.enable_mtp:
        logger.warning(
            "mtp-routing: MTP requested, but %s serves without MTP: %s. To get MTP, %s",
            Path(info.model_path).name, bundle.mtp_unavailable_reason, NO_MTP_HINT,
        )
        router.mtp_decode = MTPUnavailable(str(bundle.mtp_unavailable_reason))
    vocab = int((info.config.get("text_config") or info.config).get("vocab_size") or 1024)
    STATE.vocab_size = vocab
    weights = functools.cache(lambda: fingerprint(bundle.model))  # the calibration file's key and the disk tier's folder
    router.prefill_budget = calibration_file.calibrated(
        bundle.model, max_chunk=router.settings.prefill_step_size, ratio=STATE.prefill_stall_ratio, vocab_size=vocab,
        path=STATE.calibration_file, remeasure=STATE.recalibrate,
        weights=weights() if STATE.calibration_file is not None else None,
    )
    prefix_cache = _prefix_cache(bundle.model, router, with_head=bundle.mtp is not None, weights=weights)
    text_engine = TextEngine(
        bundle.model,
        info.tokenizer,
        max_num_seqs=router.settings.max_num_seqs,
        prefill_step_size=router.settings.prefill_step_size,
        eos_token_ids=eos_token_ids(Path(info.model_path), info.config, info.tokenizer),
        decode=router.mtp_decode if bundle.mtp is not None else None,
        prefix_cache=prefix_cache,
        specprefill=_specprefill(router, info),
    )
    router.prefill_budget.apply(text_engine.scheduler)
    _warm_up(text_engine)
    # Built once the text path knows whether MTP loaded: its projection comes from the engine.
    router.admission = _admission_controller(info, router, text_engine)
    if router.admission is not None and prefix_cache is not None:  # the cache's bytes are used memory
        router.admission.cache_bytes = lambda: prefix_cache.nbytes
    from .host import logprobs_response
    from .prompt_preparation import PromptPreparer

    logprobs_response.install()
    router.prompts = PromptPreparer.create(info.tokenizer)
    started = router.start_text_path(text_engine)
    gc_pauses.freeze_startup_heap()
    return started


def _warm_up(text_engine: Any) -> None:
    if not warmup.enabled(STATE.text_warmup):
        return
    try:
        done = text_engine.warm_up()
    except Exception:  # the first requests pay the compiles instead; a step that cannot run fails them as it did here
        logger.exception("mtp-routing: the text path's start-up warm-up failed; serving without it")
        return
    verify = f" and a {done.draft_tokens}-draft MTP verify at {_sizes(done.verify_batch_sizes)}" if done.verify_batch_sizes else ""
    logger.info(
        "mtp-routing: text decode warmed up at batch sizes %s (a plain step%s) in %.1f s (--text-warmup %s)",
        _sizes(done.batch_sizes), verify, done.seconds, STATE.text_warmup,
    )


def _sizes(sizes: list[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 and sizes == list(range(sizes[0], sizes[-1] + 1)) else ",".join(map(str, sizes))


def _specprefill(router: RoutingEngine, info: ModelInfo) -> Any:
    if STATE.specprefill is None:
        return None
    from .specprefill import SpecPrefill
    from .specprefill.scoring import attention_layers

    settings, draft_path = STATE.specprefill
    specprefill_flags.check_loaded_tokenizer(draft_path, info.tokenizer)
    draft = specprefill_flags.load_draft(router.wrapped, draft_path)
    attention_layers(draft)  # a draft whose queries cannot be read fails start-up, not a request
    logger.info(
        "mtp-routing: SpecPrefill on the text path: draft %s, prompts over %d tokens (after a prefix-cache hit) keep %.0f%% "
        "(%.0f%% evenly spaced) in %d-token chunks, scored between decode steps",
        draft_path, settings.threshold, settings.keep_pct * 100, settings.backbone_pct * 100, settings.chunk_tokens,
    )
    return SpecPrefill(draft, settings)


def _prefix_cache(model: Any, router: RoutingEngine, *, with_head: bool, weights: Callable[[], str]) -> Any:
    settings = STATE.prefix_cache or prefix_settings.from_args(None)
    if not settings.enabled or settings.budget_bytes <= 0:
        logger.info("mtp-routing: text-path prefix cache off (%s)", "--disable-prefix-cache" if not settings.enabled else "budget 0")
        return None
    from .prefix_cache.cache import PrefixCache

    disk = None
    if settings.ssd_dir:
        from .prefix_cache.disk_tier import DiskTier

        disk = DiskTier(Path(settings.ssd_dir), settings.ssd_budget_bytes, weights())
        logger.info("mtp-routing: text-path prefix cache spills to %s (up to %.1f GB)", disk.dir, settings.ssd_budget_bytes / 1e9)
    cache = PrefixCache(model, settings.budget_bytes, with_head=with_head, disk=disk)
    from .host import usage
    from .prefix_cache.metrics import register_metrics

    usage.install()
    register_metrics(cache)
    if STATE.warm_prompts:
        router.warm_prefixes = engine_access.warm_prompt_prefixes(STATE.warm_prompts, router.tokenizer_for_text)
    logger.info(
        "mtp-routing: text-path prefix cache on, budget %.0f MiB (system prompts, conversations, tool turns; snapshots of "
        "attention KV, gated-delta state%s)", settings.budget_bytes / 2**20, " and the MTP head" if cache.with_head else "",
    )
    return cache


@hookimpl
def vllm_mlx_pre_generate(request: GenerationRequest) -> None:
    """Carry what the host's request models drop: the priority header, the OpenAI ``seed``,
    ``frequency_penalty`` and ``logprobs`` fields, ``logit_bias`` on completions, and Anthropic's ``stop_sequences``."""
    if not STATE.routing_active:
        return
    value = request.headers.get(PRIORITY_HEADER)
    if value is not None:
        try:
            request.options["priority"] = int(value)
        except ValueError:
            raise RequestRejected(400, f"X-Request-Priority must be an integer, got {value!r}") from None
    validate_parameters(request.body, request.options)
    validate_logit_bias(request.body.get("logit_bias"), STATE.vocab_size)
    validate_inline_images(request.body.get("messages") if request.body else request.messages)
    seed = request.body.get("seed")
    if seed is not None:
        request.options["seed"] = int(seed)
    stops = request.body.get("stop_sequences")  # Anthropic's stop list: the host drops it (vllm-mlx 0.6.0)
    if stops and not request.options.get("stop"):
        request.options["stop"] = [stops] if isinstance(stops, str) else list(stops)
    request.options.update(body_sampling_options(request.method, request.body))
    if request.method in ("generate", "stream_generate") and request.body.get("logit_bias"):
        engine_access.attach_logit_bias(request.options, request.body["logit_bias"])


@hookimpl
def vllm_mlx_stats(engine: Any) -> dict[str, Any]:
    stats: dict[str, Any] = {"version": __version__}
    router = find_decorator(engine, RoutingEngine)
    if router is not None:
        stats.update(router.routing_stats())
    else:
        stats["routing"] = None
    return stats
