"""The --scheduler-* flags: declared on the host's serve parser, validated once at start.

GB in --scheduler-headroom-gb means GiB (2**30 bytes), the unit MLX and Metal report memory in.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from ..flag_types import int_at_least, non_negative, seconds
from ..plugin_api.errors import FlagError
from .device_memory import GiB, default_headroom_bytes, device_memory_bytes
from .policies import POLICIES

DEFAULT_MAX_QUEUE = 128
DEFAULT_QUEUE_TIMEOUT_S = 300.0
DEFAULT_MAX_RUNNING = 256  # the host's --max-num-seqs default


@dataclass(frozen=True)
class AdmissionSettings:
    policy: str
    headroom_bytes: int
    device_bytes: int
    device_source: str
    max_running: int
    max_queue: int
    queue_timeout_s: float | None  # None: wait as long as it takes

    @property
    def budget_bytes(self) -> int:
        return self.device_bytes - self.headroom_bytes


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--scheduler-policy",
        choices=POLICIES,
        default="fifo",
        help="Order in which waiting requests are admitted: fifo (arrival), shortest-first "
        "(prompt + max tokens) or priority (X-Request-Priority header, higher first). Default fifo.",
    )
    parser.add_argument(
        "--scheduler-headroom-gb",
        type=non_negative,
        default=None,
        metavar="G",
        help="Memory (GiB) kept free below the device's memory; requests are admitted while their "
        "projected use fits the rest. Default: 10%% (at least 1 GiB) of Metal's recommended working "
        "set or of CUDA memory, 15%% (at least 2 GiB) of RAM on CPU.",
    )
    parser.add_argument(
        "--scheduler-max-queue",
        type=int_at_least(0),
        default=DEFAULT_MAX_QUEUE,
        metavar="N",
        help=f"Requests that may wait for room; more are answered 503 + Retry-After. Default {DEFAULT_MAX_QUEUE}.",
    )
    parser.add_argument(
        "--scheduler-queue-timeout",
        type=seconds,
        default=DEFAULT_QUEUE_TIMEOUT_S,
        metavar="S",
        help="Seconds a request may wait for room before a 503 + Retry-After ('inf': no limit). "
        f"Default {DEFAULT_QUEUE_TIMEOUT_S:g}.",
    )


def validate(args: Any, *, device: tuple[int, str] | None = None) -> AdmissionSettings:
    """Check the flags against each other and the device; raise FlagError naming the bad one."""
    device_bytes, source = device if device is not None else device_memory_bytes()

    headroom_gb = getattr(args, "scheduler_headroom_gb", None)
    if headroom_gb is None:
        headroom = default_headroom_bytes(device_bytes, source)
    else:
        if not math.isfinite(headroom_gb) or headroom_gb < 0:
            raise FlagError("--scheduler-headroom-gb", f"must be a finite number >= 0, got {headroom_gb}")
        headroom = int(headroom_gb * GiB)
        if headroom >= device_bytes:
            raise FlagError(
                "--scheduler-headroom-gb",
                f"{headroom_gb:g} GiB leaves nothing of the device's {device_bytes / GiB:.2f} GiB ({source})",
            )

    max_queue = getattr(args, "scheduler_max_queue", DEFAULT_MAX_QUEUE)
    if max_queue is None or max_queue < 0:
        raise FlagError("--scheduler-max-queue", f"must be >= 0, got {max_queue}")

    timeout = getattr(args, "scheduler_queue_timeout", DEFAULT_QUEUE_TIMEOUT_S)
    if timeout is None or math.isnan(timeout) or timeout <= 0:
        raise FlagError("--scheduler-queue-timeout", f"must be > 0 seconds, got {timeout}")

    max_running = getattr(args, "max_num_seqs", None)
    max_running = DEFAULT_MAX_RUNNING if max_running is None else max_running
    if max_running < 1:
        raise FlagError("--max-num-seqs", f"must be >= 1, got {max_running}")

    return AdmissionSettings(
        policy=getattr(args, "scheduler_policy", "fifo") or "fifo",
        headroom_bytes=headroom,
        device_bytes=device_bytes,
        device_source=source,
        max_running=int(max_running),
        max_queue=int(max_queue),
        queue_timeout_s=None if math.isinf(timeout) else float(timeout),
    )


def check_budget_after_load(settings: AdmissionSettings, active_bytes: int) -> None:
    """After the model is loaded: the budget must leave room above what is already resident."""
    if active_bytes >= settings.budget_bytes:
        raise FlagError(
            "--scheduler-headroom-gb",
            f"leaves a budget of {settings.budget_bytes / GiB:.2f} GiB, but the loaded model already "
            f"uses {active_bytes / GiB:.2f} GiB of the device's {settings.device_bytes / GiB:.2f} GiB "
            f"({settings.device_source}); lower the headroom or use a smaller model",
        )
