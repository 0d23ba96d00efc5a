"""The plugin's settings: its flags (declared here), read and checked once into one frozen config.

``PluginConfig.from_args`` runs in the flag-validation hook, before anything loads; a bad value raises
``FlagError`` naming the flag. ``RoutingSettings`` are what the routing engine reads of the host's own
scheduler settings (``--enable-mtp``, ``--max-num-seqs``, ...), read from the engine the host built.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import admission
from .flag_types import count_or_all, int_at_least, non_negative, seconds
from .host import drain, engine_access, specprefill_flags
from .prefix_cache import settings as prefix_settings
from .specprefill.settings import SpecPrefillSettings
from .text_engine import calibration_file, warmup
from .text_engine.prefill_budget import DEFAULT_RATIO as DEFAULT_STALL_RATIO
from .text_engine.spec.proposer import DEFAULT_PROMPT_PAIRS


@dataclass(frozen=True)
class SpecPrefillConfig:
    settings: SpecPrefillSettings
    draft_path: str


@dataclass(frozen=True)
class PluginConfig:
    """What the flags ask of the text path. The defaults are those of a host that never validated the flags."""

    admission: admission.AdmissionSettings | None = None  # None: no admission control
    mtp_schedule: str = "adaptive"
    mtp_max_batch_size: int | None = None
    mtp_prompt_pairs: int | None = DEFAULT_PROMPT_PAIRS  # None: every prompt position
    prefill_stall_ratio: float = DEFAULT_STALL_RATIO
    calibration_file: Path | None = None  # --prefill-calibration-file (None: 'none')
    recalibrate: bool = False
    text_warmup: str = "auto"
    prefix_cache: prefix_settings.PrefixCacheSettings | None = None  # None: the host's defaults, read at load
    warm_prompts: str | None = None  # --warm-prompts: the host's file of prompts sent at start
    specprefill: SpecPrefillConfig | None = None  # with --specprefill on the text path
    strict_max_tokens: bool = False  # --strict-max-tokens
    drain_timeout: float = drain.DEFAULT_TIMEOUT_S  # --drain-timeout (inf: no limit)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PluginConfig:
        """Check the flags (FlagError naming the first bad one, in this order) and read them."""
        admission_settings = admission.validate(args)
        calibration = calibration_file.from_flag(getattr(args, "prefill_calibration_file", None))
        prefix_cache = prefix_settings.from_args(args)
        specprefill = specprefill_flags.from_args(args)
        return cls(
            admission=admission_settings,
            mtp_schedule=args.mtp_schedule,
            mtp_max_batch_size=args.mtp_max_batch_size,
            mtp_prompt_pairs=getattr(args, "mtp_prompt_pairs", DEFAULT_PROMPT_PAIRS),
            prefill_stall_ratio=float(getattr(args, "prefill_stall_ratio", DEFAULT_STALL_RATIO)),
            calibration_file=calibration,
            recalibrate=bool(getattr(args, "prefill_recalibrate", False)),
            text_warmup=getattr(args, "text_warmup", "auto"),
            prefix_cache=prefix_cache,
            warm_prompts=getattr(args, "warm_prompts", None),
            specprefill=SpecPrefillConfig(*specprefill) if specprefill is not None else None,
            strict_max_tokens=bool(getattr(args, "strict_max_tokens", False)),
            drain_timeout=float(getattr(args, "drain_timeout", drain.DEFAULT_TIMEOUT_S)),
        )


@dataclass(frozen=True)
class RoutingSettings:
    """The host's scheduler settings the text path follows."""

    enable_mtp: bool = False
    mtp_num_draft_tokens: int = 1
    max_num_seqs: int = 16
    prefill_step_size: int = 2048

    @classmethod
    def from_host_engine(cls, engine: Any) -> RoutingSettings:
        drafter_path, _ = engine_access.host_mtp_drafter(engine)
        return cls(
            # A host MTP drafter is a request for speculative decoding: the text path uses the same one.
            enable_mtp=bool(engine_access.scheduler_setting(engine, "enable_mtp", False)) or drafter_path is not None,
            mtp_num_draft_tokens=int(engine_access.scheduler_setting(engine, "mtp_num_draft_tokens", 1) or 1),
            max_num_seqs=int(engine_access.scheduler_setting(engine, "max_num_seqs", 16)),
            prefill_step_size=int(engine_access.scheduler_setting(engine, "prefill_step_size", 2048)),
        )


def add_arguments(group: Any) -> None:
    group.add_argument(
        "--mtp-routing-disable",
        action="store_true",
        help="Load the plugin but leave the engine as the host built it (every request on the host's path).",
    )
    group.add_argument(
        "--mtp-schedule",
        choices=("adaptive", "always"),
        default="adaptive",
        help="Text-path MTP with --enable-mtp: 'adaptive' (default) drafts a step where the rows' recent acceptance "
        "pays for a drafting step's cost, measured per batch size against a plain step; 'always' drafts every step "
        "for every row.",
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
    group.add_argument(
        "--strict-max-tokens",
        action="store_true",
        help="Refuse (400) a request whose explicit max_tokens does not fit the model's context after its prompt, as "
        "vLLM does. Default: cut it to what the context leaves (the response ends with finish_reason 'length'), as "
        "vllm-mlx and mlx-lm's server do. A prompt alone over the context is a 400 either way.",
    )
    group.add_argument(
        "--drain-timeout",
        type=seconds,
        default=drain.DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="On SIGTERM or Ctrl-C the server stops listening and lets running requests finish for at most SECONDS "
        f"(default {drain.DEFAULT_TIMEOUT_S:g}; 'inf': no limit, as the host alone); then each one still running is ended "
        "with a retryable 503 (a status, or an error event in a stream that started) instead of a reset. A second signal "
        "ends them at once. Set it below your supervisor's kill timeout. /health answers 503 while draining.",
    )
    admission.add_arguments(group)
