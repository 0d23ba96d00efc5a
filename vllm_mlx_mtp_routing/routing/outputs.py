"""What both paths hand back to the host: the host's ``GenerationOutput``; a chat template's own error as a 400."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any

from ..host import engine_access as host
from ..plugin_api.errors import RequestRejected
from ..specprefill.pipeline import OUTCOME_REASONS, outcome
from ..text_engine.state import TextOutput


def no_draft_outcome(prompt_tokens: int) -> dict[str, Any]:
    return outcome(True, OUTCOME_REASONS["no_draft"], prompt_tokens - 1)


def to_generation_output(out: TextOutput, *, streaming: bool) -> Any:
    return host.GenerationOutput(
        text=host.clean_output_text(out.text),
        tokens=list(out.token_ids) if not streaming else [],
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        finish_reason=out.finish_reason,
        new_text=out.new_text,
        finished=out.finished,
        mtp_drafts=out.mtp_drafted,
        mtp_accepted=out.mtp_accepted,
        specprefill_outcome=host.specprefill_outcome(out.specprefill),
    )


def _is_template_error(exc: BaseException) -> bool:
    import jinja2

    return isinstance(exc, jinja2.TemplateError)


async def host_call(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as exc:
        if _is_template_error(exc):
            raise RequestRejected(400, f"chat template error: {exc}") from exc
        raise


async def host_stream(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        async for out in stream:
            yield out
    except Exception as exc:
        if _is_template_error(exc):
            raise RequestRejected(400, f"chat template error: {exc}") from exc
        raise
