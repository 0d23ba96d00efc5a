"""Per-response reused prompt tokens in the host's usage objects (vllm-mlx 0.6.0 internals).

The host builds ``Usage(prompt_tokens=..., ...)`` (OpenAI, ``vllm_mlx.api.models``) and
``AnthropicUsage(input_tokens=..., ...)`` itself from a ``GenerationOutput`` that has no field for
cached tokens. The text path records a request's reused tokens on the plugin's per-request
context (``asgi.current()``, shared by every task the request's handler starts), and the two usage
models read it when they are built: OpenAI gains ``prompt_tokens_details.cached_tokens`` (as OpenAI and mlx-lm's server
report it), Anthropic's existing ``cache_read_input_tokens`` is filled and, as Anthropic counts them,
taken out of ``input_tokens`` (input + cache reads = the prompt). Requests the text path did not serve
leave both at None.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, model_validator
from pydantic.fields import FieldInfo

from . import asgi


def record(cached_tokens: int) -> None:
    """The current request reused this many prompt tokens (call from the engine side)."""
    ctx = asgi.current()
    if ctx is not None:
        ctx.cached_tokens = cached_tokens


def _cached() -> int | None:
    return getattr(asgi.current(), "cached_tokens", None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


def _openai_details() -> PromptTokensDetails | None:
    n = _cached()
    return None if n is None else PromptTokensDetails(cached_tokens=n)


def _anthropic_cache_read() -> int | None:
    return _cached()


_installed = False


def install() -> None:
    """Add the fields (idempotent); models that embed the usage models are rebuilt to see them."""
    global _installed
    if _installed:
        return
    from vllm_mlx.api import anthropic_models, models

    models.Usage.model_fields["prompt_tokens_details"] = FieldInfo(
        annotation=Optional[PromptTokensDetails], default_factory=_openai_details  # noqa: UP045 - a value pydantic reads at run time, left as it was
    )
    anthropic_models.AnthropicUsage.model_fields["cache_read_input_tokens"] = FieldInfo(
        annotation=Optional[int], default_factory=_anthropic_cache_read  # noqa: UP045 - a value pydantic reads at run time, left as it was
    )
    for module, base in ((models, models.Usage), (anthropic_models, anthropic_models.AnthropicUsage)):
        base.model_rebuild(force=True)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseModel) and value is not base:
                if any(_mentions(f.annotation, base) for f in value.model_fields.values()):
                    value.model_rebuild(force=True)
    _count_cache_reads_apart(anthropic_models.AnthropicUsage)
    _installed = True


def _count_cache_reads_apart(base: type[BaseModel]) -> None:
    """Anthropic's ``input_tokens`` excludes ``cache_read_input_tokens``; the host fills it with the whole
    prompt. A subclass with that rule replaces the name where the host builds non-streamed usage
    (vllm-mlx 0.6.0: ``server`` and ``api.anthropic_adapter`` import it by name); an instance of it is
    still an ``AnthropicUsage`` wherever one is expected."""
    from vllm_mlx import server
    from vllm_mlx.api import anthropic_adapter, anthropic_models

    class AnthropicUsage(base):  # type: ignore[misc, valid-type]
        @model_validator(mode="after")
        def _reads_apart(self) -> Any:
            reads = getattr(self, "cache_read_input_tokens", None)
            if reads:
                self.input_tokens = max(0, self.input_tokens - reads)  # type: ignore[has-type]
            return self

    for module in (server, anthropic_adapter, anthropic_models):
        if getattr(module, "AnthropicUsage", None) is base:
            module.AnthropicUsage = AnthropicUsage


def _mentions(annotation: Any, cls: type) -> bool:
    if annotation is cls:
        return True
    return any(_mentions(a, cls) for a in getattr(annotation, "__args__", ()) or ())
