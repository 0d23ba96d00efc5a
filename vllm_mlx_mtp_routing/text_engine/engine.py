"""The asyncio face of the text engine: one step task on the event loop, streams per request.

All MLX work (prefill, decode, cache joins and drops) runs in ``BatchScheduler.step`` or
``abort``, called only from the event-loop thread, the thread that owns the model's arrays and
streams. After each step the task yields several loop cycles so that another scheduler stepping on
the same loop (the host's MLLM scheduler) and the HTTP handlers get their turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import mlx.nn as nn

from ..admission.memory_model import MemoryModel
from ..model.media_forward import VisionParts
from ..prefix_cache.cache import PrefixCache
from ..specprefill.pipeline import SpecPrefill
from ..specprefill.settings import RequestChoice
from . import warmup
from .sampling import SamplingOptions
from .scheduler import BatchScheduler
from .shared_prefill import SharedPrefill
from .spec.mtp import MTPDecode
from .state import MediaInput, TextOutput, TextRequest

logger = logging.getLogger(__name__)

_YIELDS_PER_STEP = 5  # as vllm-mlx 0.6.0 mllm_scheduler._process_loop: an HTTP request needs ~3
# After a long step with no row decoding (a lone prompt's chunk, up to ~2 s on a CPU), the loop pauses this long: a new
# request needs a few loop turns and a prompt worker's reply before it reaches the engine, and with only the yields it
# took one step per turn (a question sent beside a lone 7K-token prompt was added after 6 chunks, ~10 s).
_LONG_STEP_S = 0.1
_IDLE_PAUSE_S = 0.01


class TextEngineError(RuntimeError):
    """A request failed inside the engine; the other requests carry on."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id


class TextEngine:
    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        max_num_seqs: int = 16,
        prefill_step_size: int = 2048,
        eos_token_ids: list[int] | None = None,
        decode: MTPDecode | None = None,
        prefix_cache: PrefixCache | None = None,
        specprefill: SpecPrefill | None = None,
        vision: VisionParts | None = None,
    ) -> None:
        self.scheduler = BatchScheduler(
            model,
            tokenizer,
            max_num_seqs=max_num_seqs,
            prefill_step_size=prefill_step_size,
            eos_token_ids=eos_token_ids,
            decode=decode,
            prefix_cache=prefix_cache,
            specprefill=specprefill,
            vision=vision,
        )
        self._queues: dict[str, asyncio.Queue[TextOutput]] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._step_seconds = 0.0
        self._loop_errors = 0
        self.warmup: warmup.Warmup | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self.running:
            return
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="text-engine-step")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for rid in list(self._queues):
            out = self.scheduler.abort(rid)
            if out is not None:
                self._deliver(out)

    async def add_request(
        self,
        prompt_ids: list[int],
        options: SamplingOptions,
        request_id: str | None = None,
        snapshot_at: list[tuple[int, str]] | None = None,
        *,
        on_joined: Callable[[], None] | None = None,
        share: SharedPrefill | None = None,
        specprefill: RequestChoice | None = None,
        cache_salt: str | None = None,
        media: MediaInput | None = None,
    ) -> str:
        """Queue a request. ``snapshot_at``: prompt positions worth a prefix-cache snapshot
        (``TextRequest``); ``on_joined`` runs (on the step's thread) when its prefill is done and it
        joins the decode batch; ``share``: it is one of the n rows of a request, prefilled once;
        ``specprefill``: its ``specprefill.settings.RequestChoice``; ``cache_salt``: the prefix-cache
        entries it reads and makes are those of this salt only; ``media``: its images (a media row)."""
        if not self.running:
            raise RuntimeError("TextEngine is not started")
        rid = request_id or uuid.uuid4().hex
        if rid in self._queues:
            raise ValueError(f"duplicate request id {rid!r}")
        self.scheduler.add(
            TextRequest(rid, list(prompt_ids), options, list(snapshot_at or ()), on_joined, share=share, specprefill=specprefill,
                        cache_salt=cache_salt, media=media)
        )
        self._queues[rid] = asyncio.Queue()
        assert self._wakeup is not None  # made by start
        self._wakeup.set()
        return rid

    async def stream(self, request_id: str) -> AsyncIterator[TextOutput]:
        """Outputs of one request until it finishes; raises TextEngineError if it failed.

        Leaving the iteration early (client disconnect, cancellation) aborts the request.
        """
        queue = self._queues.get(request_id)
        if queue is None:
            raise KeyError(f"unknown request id {request_id!r}")
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                if out.finish_reason == "error":
                    raise TextEngineError(request_id, out.error or "unknown error")
                yield out
        finally:
            if not finished:
                await self.abort(request_id)
            self._queues.pop(request_id, None)

    async def generate(self, prompt_ids: list[int], options: SamplingOptions) -> TextOutput:
        rid = await self.add_request(prompt_ids, options)
        last = None
        async for out in self.stream(rid):
            last = out
        assert last is not None  # a stream ends with the request's final output
        return last

    async def abort(self, request_id: str) -> bool:
        return self.abort_now(request_id)

    def abort_now(self, request_id: str, *, forget: bool = False) -> bool:
        """Abort between steps (any callback on the loop thread is); ``forget`` also drops its output queue."""
        out = self.scheduler.abort(request_id)
        if out is not None:
            self._deliver(out)
        if forget:
            self._queues.pop(request_id, None)
        return out is not None

    def warm_up(self, max_batch: int = warmup.MAX_BATCH) -> warmup.Warmup:
        """Step throwaway rows through the decode at batch sizes 1..min(max_num_seqs, ``max_batch``) so that requests
        meet no first-use compiles (warmup.py). Once, before ``start``, on the thread that owns the model."""
        if self.running or self.scheduler.has_work():
            raise RuntimeError("the text engine warms up before it serves")
        self.warmup = warmup.run(self.scheduler, range(1, min(self.scheduler.max_num_seqs, max_batch) + 1))
        return self.warmup

    def memory_model(self) -> MemoryModel:
        """What this engine allocates per request: admission's projection for the text path."""
        return self.scheduler.memory_model()

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix_cache

    @property
    def specprefill(self) -> SpecPrefill | None:
        return self.scheduler.specprefill

    def counts(self) -> dict[str, int]:
        """Rows running, prefilling and waiting: what ``/health`` asks for, polled often, without the
        rest of ``stats``."""
        return self.scheduler.counts()

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        s["step_seconds_total"] = round(self._step_seconds, 3)
        s["loop_errors"] = self._loop_errors
        s["warmup"] = self.warmup.stats() if self.warmup is not None else None
        return s

    def _deliver(self, out: TextOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)

    async def _loop(self) -> None:
        while True:
            if not self.scheduler.has_work():
                assert self._wakeup is not None  # made by start, before this task
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            tic = time.perf_counter()
            try:
                outputs = self.scheduler.step()
            except Exception as e:  # a fault outside the per-request handling: fail, keep looping
                logger.exception("text engine step failed")
                self._loop_errors += 1
                outputs = self.scheduler.fail_all(e)
            self._step_seconds += time.perf_counter() - tic
            for out in outputs:
                self._deliver(out)
            if time.perf_counter() - tic > _LONG_STEP_S and not self.scheduler.running:
                await asyncio.sleep(_IDLE_PAUSE_S)  # no stream's cadence to keep: let new requests in
            else:
                for _ in range(_YIELDS_PER_STEP):
                    await asyncio.sleep(0)
            try:  # once the streams have written this step's outputs
                self.scheduler.finish_delivered()
            except Exception:
                logger.exception("text engine: work after a step's delivery failed")
