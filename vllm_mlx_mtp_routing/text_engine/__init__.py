"""Continuous-batching text engine for mlx-lm hybrid (gated-delta + attention) models, exact under batching."""

from .batch import BatchScheduler
from .batch_cache import BatchCache, RaggedKVCache
from .decode import DecodeResult, DecodeStrategy, SingleTokenDecode
from .engine import TextEngine, TextEngineError
from .mtp_decode import MTPDecode
from .outputs import TextOutput
from .rows import DecodeBatch, PrefillState, Row, TextRequest
from .sampling import SamplingOptions

__all__ = [
    "BatchCache",
    "BatchScheduler",
    "DecodeBatch",
    "DecodeResult",
    "DecodeStrategy",
    "MTPDecode",
    "PrefillState",
    "RaggedKVCache",
    "Row",
    "SamplingOptions",
    "SingleTokenDecode",
    "TextEngine",
    "TextEngineError",
    "TextOutput",
    "TextRequest",
]
