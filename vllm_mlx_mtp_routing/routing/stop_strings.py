"""Stop strings on the host's mlx-vlm path, which vllm-mlx 0.6.0 drops there (``BatchedEngine.generate``
/ ``stream_generate`` pass no ``stop`` to the MLLM scheduler).

The host's outputs are cut as the text path cuts its own (``text_engine.detokenize``): text that
could still be the start of a stop string is held back, the stop string is never emitted, and the
request ends at it with finish_reason "stop" (closing the host's stream aborts its request there).
A non-streamed request is served from the host's stream, so it too stops at the stop string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ..text_engine.detokenize import _held_back


def of(options: dict[str, Any]) -> list[str]:
    stop = options.get("stop") or []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if isinstance(s, str) and s]


class StopCut:
    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""
        self.released = 0
        self.hit = False

    def feed(self, new_text: str, final: bool) -> str:
        """What may be released after ``new_text``; sets ``hit`` at a stop string (cut before it)."""
        start = max(0, len(self.text) - max(len(s) for s in self.stops) + 1)
        self.text += new_text
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text, self.hit = self.text[: min(found)], True
        end = len(self.text) if final or self.hit else len(self.text) - _held_back(self.text, self.stops)
        out, self.released = self.text[self.released : end], max(self.released, end)
        return out


async def cut(stream: AsyncGenerator[Any, None], stops: list[str]) -> AsyncIterator[Any]:
    """The host's ``GenerationOutput`` stream, ended at the first stop string (as it is without any)."""
    if not stops:
        async for out in stream:
            yield out
        return
    state = StopCut(stops)
    try:
        async for out in stream:
            delta = state.feed(out.new_text or "", bool(out.finished))
            if state.hit:
                yield dataclasses.replace(out, text=state.text, new_text=delta, finished=True, finish_reason="stop")
                return
            yield dataclasses.replace(out, text=state.text[: state.released], new_text=delta)
    finally:
        await stream.aclose()  # vllm-mlx 0.6.0: closing the MLLM scheduler's stream aborts its request


async def result(stream: AsyncGenerator[Any, None], stops: list[str]) -> Any:
    """A non-streamed result from the host's stream, ended at the first stop string."""
    last = None
    async for out in cut(stream, stops):
        last = out
    if last is None:
        raise RuntimeError("the host's stream ended without output")
    return dataclasses.replace(last, new_text="")
