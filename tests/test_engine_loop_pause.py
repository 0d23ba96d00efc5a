"""The text engine's loop after a long step with no row decoding (a lone prompt's chunk): it pauses for the event loop,
so a new request's hops (a worker's reply, the admission) finish between two such steps, not one hop per step."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from vllm_mlx_mtp_routing.text_engine import engine as engine_module
from vllm_mlx_mtp_routing.text_engine.engine import TextEngine


class LoneLongPrompt:
    """A scheduler whose every step holds the event loop like a lone prompt's chunk: ``seconds``, no row decoding."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.stepped, self.running = seconds, 0, []

    def has_work(self) -> bool:
        return True

    def step(self) -> list[Any]:
        time.sleep(self.seconds)  # the chunk's eval: the loop's thread is busy
        self.stepped += 1
        return []

    def finish_delivered(self) -> None:
        pass


def test_a_new_requests_hops_finish_between_two_long_idle_steps(tiny, monkeypatch):
    monkeypatch.setattr(engine_module, "_IDLE_PAUSE_S", 0.2)  # ample for a worker thread's reply on a loaded machine
    bundle, tok = tiny

    async def main() -> list[int]:
        engine = TextEngine(bundle.model, tok)
        engine.scheduler = fake = LoneLongPrompt(seconds=0.15)  # type: ignore[assignment]
        loop_task = asyncio.create_task(engine._loop())
        await asyncio.sleep(0)  # the first step starts
        at = []
        for _ in range(3):  # a request's hops: the prompt worker, then the loop's own callbacks
            await asyncio.get_running_loop().run_in_executor(None, lambda: None)
            at.append(fake.stepped)
        loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop_task
        return at

    at = asyncio.run(main())
    assert at[-1] - at[0] <= 1, at  # a step per hop: at[-1] - at[0] == 2
