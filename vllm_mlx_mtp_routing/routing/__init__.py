"""Per-request routing: text requests to the text engine, media requests to the host's mlx-vlm path.

``engine``: the routing engine (one serve path for chat and completion, a result or a stream); ``parts``: what it
serves with once the model is loaded; ``media``: which requests carry media; ``request_options`` and
``request_validation``: a request's options and their checks; ``normalize``: chat messages before the template;
``prompt_preparation``: a text prompt's tokens off the event loop; ``stop_strings``: stop strings on the host's path;
``fallbacks``: why a text request went to the host's path.
"""

from ..config import RoutingSettings
from .engine import RoutingEngine
from .media import has_media
from .parts import ServingParts, TextPath
from .request_options import sampling_options, text_path_gap

__all__ = ["RoutingEngine", "RoutingSettings", "ServingParts", "TextPath", "has_media", "sampling_options", "text_path_gap"]
