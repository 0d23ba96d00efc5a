"""Why the plugin routes nothing, and what the operator can do about it: one log line at start-up and the
``routing`` block of ``/v1/status`` (``{"enabled": false, "reason": ..., "fix": ...}``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm_mlx_mtp_routing")

EVERY_REQUEST = "every request takes the host's own path (no text path, MTP, prefix cache or admission from this plugin)"


@dataclass(frozen=True)
class RoutingOff:
    reason: str
    fix: str | None  # None: the operator asked for it
    consequence: str = EVERY_REQUEST

    def status(self) -> dict[str, Any]:
        return {"enabled": False, "reason": self.reason, **({"fix": self.fix} if self.fix else {})}

    def log(self) -> None:
        """A WARNING when something the operator asked for (the plugin) does not work; INFO when they turned it off."""
        if self.fix is None:
            logger.info("mtp-routing: routing is off: %s; %s", self.reason, self.consequence)
        else:
            logger.warning("mtp-routing: routing is off: %s; %s. To route: %s", self.reason, self.consequence, self.fix)


def by_flag() -> RoutingOff:
    return RoutingOff("disabled by --mtp-routing-disable", None)


def no_continuous_batching() -> RoutingOff:
    return RoutingOff(
        "the server runs without --continuous-batching (the plugin routes the host's batched engine only)",
        "add --continuous-batching",
    )


def not_a_vlm(model: str) -> RoutingOff:
    return RoutingOff(
        f"{model} is served as a text-only model, not a vision-language model (VLM)",
        "serve a Qwen3.5 VLM checkpoint (--mllm where the host does not detect one)",
    )


def no_text_path(reason: str) -> RoutingOff:
    """The model loaded, but the text path cannot be built from it (another model family, say)."""
    return RoutingOff(
        f"no text path for this model: {reason}",
        "serve a Qwen3.5 checkpoint (model_type qwen3_5 or qwen3_5_moe)",
        "every request takes the host's mlx-vlm path (with the plugin's admission, message normalization and stop "
        "strings; no text path, MTP or prefix cache)",
    )
