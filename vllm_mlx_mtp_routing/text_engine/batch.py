"""The synchronous continuous-batching core: admission, chunked prefill, batched decode.

Exactness. A request's output does not depend on what else is running:

- prefill runs every request alone, on its own single-sequence mlx-lm cache (``model.make_cache()``),
  over ``prompt[:-1]`` in chunks cut at fixed multiples of ``prefill_step_size`` from the start of
  its prompt (as ``mlx_lm.generate.generate_step`` does), so neither padding nor other prompts ever
  enter its forward passes and its chunk boundaries never depend on the other requests;
- the prefilled cache then joins the decode batch as a new row of a ``BatchCache`` (per-row KV
  lengths and RoPE offsets, per-row gated-delta state, nothing padded in front of a row), and the
  row's first decode step feeds its last prompt token;
- each row samples with its own PRNG key.

Why not mlx-lm's ``BatchGenerator`` (0.31.3): it prefills a batch of prompts right-padded to the
longest, telling the gated-delta caches the real lengths with ``ArraysCache.prepare(lengths=...)``.
But the batch's caches come from ``ArraysCache.merge`` (mlx_lm/models/cache.py, ``ArraysCache.merge``,
the early return for all-empty caches), which sets ``left_padding = zeros(B)``, and
``ArraysCache.make_mask`` tests ``left_padding`` before ``lengths``: the mask becomes all-True, so
``GatedDeltaNet.__call__`` (mlx_lm/models/qwen3_5.py) neither zeroes the padded ``qkv`` nor freezes
the recurrent state at padded positions. The recurrent state of every row shorter than the longest
prompt in its prefill chunk absorbs the padding tokens (the conv state is still cut at ``lengths``,
and the attention KV is right-shifted correctly by ``BatchKVCache.finalize``). With
``prefill_step_size=1`` no chunk is padded, which is why that setting is exact.
tests/test_text_engine_batchgen_bug.py pins this.

Step rule (``step``): admit waiting requests while running + prefilling < ``max_num_seqs``; run
prefill chunks, oldest request first, while this step's prompt tokens stay within
``prefill_step_size`` (always at least one chunk; a long prompt advances one chunk per step,
several short ones share a step; a request waits for the one before it); requests whose prefill
finished join the batch (one longer than a chunk, while rows are decoding, at the start of the next
step rather than after this step's prefill); then one decode step for the whole batch. A long prompt
therefore delays the running rows by at most one chunk per step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import prefill_budget, row_check
from .prefill_budget import ChunkGrid
from ..prefix_cache.plan import SnapshotPlan
from .batch_cache import BatchCache
from .decode import DecodeStrategy, SingleTokenDecode
from ..admission.memory_model import MemoryModel
from .detokenize import eos_ids_of
from .footprint import engine_memory_model
from .outputs import TextOutput
from .rows import DecodeBatch, PrefillState, Row, TextRequest
from .. import gc_pauses
from .step_profile import StepProfile, StepRecord

__all__ = ["BatchScheduler", "PrefillState", "Row", "TextRequest"]

logger = logging.getLogger(__name__)


class BatchScheduler:
    """Continuous batching of text requests over an mlx-lm model; call ``step`` repeatedly."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        max_num_seqs: int = 16,
        prefill_step_size: int = 2048,
        eos_token_ids: list[int] | set[int] | None = None,
        decode: DecodeStrategy | None = None,
        prefix_cache: Any = None,
        specprefill: Any = None,
    ) -> None:
        """``prefix_cache``: a ``prefix_cache.PrefixCache`` (None: every prompt is prefilled in full);
        ``specprefill``: a ``specprefill.SpecPrefill`` (None: every prompt is prefilled densely)."""
        if max_num_seqs < 1 or prefill_step_size < 1:
            raise ValueError("max_num_seqs and prefill_step_size must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.prefill_step_size = prefill_step_size
        self.prefill_chunk = prefill_step_size  # tokens per prefill forward; prefill_budget may lower it
        self.chunk_grid: ChunkGrid | None = None  # chunks that shrink with the position (prefill_budget); None: fixed
        self.prefill_time_s: tuple[float, float] | None = None  # (x decode step, idle seconds); see prefill_budget
        self.decode_step_s = 0.0
        self.eos_ids = eos_ids_of(tokenizer) | set(eos_token_ids or ())
        self.decode = decode or SingleTokenDecode()
        self.prefix_cache = prefix_cache
        self.specprefill = specprefill
        self.waiting: deque[Row] = deque()
        self.prefilling: list[Row] = []
        # The decode batch owns the running rows and every batch cache (backbone and MTP head).
        self.batch = DecodeBatch(model, head_layers=self.decode.head_layers)
        self.decode.bind(self.batch)
        self.steps = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.shared_prefill_rows = 0  # rows that started from another row's prefill (OpenAI n)
        self.batch_size_histogram: dict[int, int] = {}
        self.profile = StepProfile()

    @property
    def running(self) -> list[Row]:
        """The decode batch's rows, in cache row order."""
        return self.batch.rows

    @property
    def cache(self) -> BatchCache:
        """The backbone's batch caches."""
        return self.batch.backbone

    # -- requests ---------------------------------------------------------------------------

    def add(self, request: TextRequest, restored: PrefillState | None = None) -> None:
        """Queue a request. ``restored``: caches that already hold ``prompt[:restored.prefilled]``
        (a prefix-cache snapshot, a sparse prefill; see ``PrefillState``): the rest of the prompt
        is prefilled on them in the usual chunks and the row joins the batch as any other. The
        state becomes the row's own (it is mutated in place by the remaining prefill)."""
        if not request.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self._find(request.request_id) is not None:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if restored is not None:
            restored.check(len(request.prompt_ids))
        self.waiting.append(Row(request, self.tokenizer, self.eos_ids, restored))

    def abort(self, request_id: str) -> TextOutput | None:
        """Remove a request now (call between steps); its final output, or None if unknown."""
        seq = self._find(request_id)
        if seq is None:
            return None
        if seq in self.running:
            self._drop_rows([seq])
        else:
            (self.prefilling if seq in self.prefilling else self.waiting).remove(seq)
            if seq.req.share is not None:
                seq.req.share.left(seq)
        seq.prefill = seq.sparse = None
        return seq.output("abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def _find(self, request_id: str) -> Row | None:
        for group in (self.running, self.prefilling, self.waiting):
            for s in group:
                if s.rid == request_id:
                    return s
        return None

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[TextOutput]:
        """Admit, prefill up to one token budget, decode the batch once; outputs of this step."""
        outputs: list[TextOutput] = []
        record = self.profile.begin(self.steps)
        try:
            while self.waiting and len(self.prefilling) + len(self.running) < self.max_num_seqs:
                self.prefilling.append(self.waiting.popleft())
            outputs += self._prefill(record)
            if self.running:
                record.rows = len(self.running)
                tic = time.perf_counter()
                outputs += self._decode()
                record.decode_s = time.perf_counter() - tic
                prefill_budget.note_decode_step(self, record.decode_s)
        finally:
            self.profile.end(streams_waiting=bool(self.running))
        self.steps += 1
        return outputs

    def _prefill(self, record: StepRecord) -> list[TextOutput]:
        outputs = []
        done, started, last = 0, time.perf_counter(), 0.0
        for seq in list(self.prefilling):
            if seq.req.share is not None and not seq.req.share.ready(seq, self.model, self.decode.head_layers > 0):
                continue  # another row of its request is prefilling the same prompt
            try:
                if seq.plan is None:  # looked up now, not at add: a prefix the request before it just prefilled counts
                    seq.plan = SnapshotPlan.start(self.prefix_cache, seq)
                    if self.specprefill is not None:  # scored and prefilled sparsely in pieces, see specprefill/
                        seq.sparse = self.specprefill.start(seq, self)
                while seq.prefilled < seq.to_prefill:
                    job = seq.sparse if seq.sparse is not None and seq.sparse.ready() else None
                    n = job.next_cost() if job is not None else self._chunk_len(seq)
                    if done and not prefill_budget.more_prefill(self, done + n, started, last):
                        break
                    tic = time.perf_counter()
                    advanced = job.advance() if job is not None else self._prefill_chunk(seq)
                    done += advanced
                    last = time.perf_counter() - tic
                    record.chunk(advanced, last)
            except Exception as e:  # only this request's own cache was touched
                logger.exception("prefill failed for %s", seq.rid)
                self.prefilling.remove(seq)
                seq.prefill = seq.sparse = None
                if seq.req.share is not None:
                    seq.req.share.left(seq)
                outputs.append(seq.output("error", error=f"{type(e).__name__}: {e}"))
                continue
            if seq.prefilled < seq.to_prefill:
                break  # budget spent: later requests wait, keeping the queue order
            if done and self.running and seq.to_prefill > self.prefill_chunk:
                # A prompt longer than a chunk joins first thing next step, not after this step's prefill: its join
                # (its KV copied into the batch; with MTP the head over the prompt's end), its first decode and, at
                # max_tokens 1, its leaving cost the streams ~1.5 decode steps more at 16K tokens on an H100
                # (benchmarks/leave_step.py), past the prefill budget this step already spent. Shorter ones join at
                # once: their joins are cheap, and a burst of them would otherwise take a step each.
                break
            tic = time.perf_counter()
            self._join(seq)
            record.joins += 1
            record.join_s += time.perf_counter() - tic
        return outputs

    def _chunk_len(self, seq: Row) -> int:
        """Chunks end on a grid of positions fixed for the server's life (multiples of the chunk size,
        or ends that draw closer deeper into a prompt; see prefill_budget), never depending on the
        other requests, and at the request's prefix-cache snapshot positions."""
        start = seq.prefilled
        grid = self.chunk_grid
        end = grid.next_end(start) if grid is not None else (start // self.prefill_chunk + 1) * self.prefill_chunk
        end = min(end, seq.to_prefill)
        return (seq.plan.cut(start, end) if seq.plan is not None else end) - start

    def _prefill_chunk(self, seq: Row) -> int:
        state = self._prefill_state(seq)
        state.prefill_to = seq.to_prefill
        start = state.prefilled
        n = self._chunk_len(seq)
        chunk = mx.array(seq.req.prompt_ids[start : start + n], dtype=mx.uint32)[None]
        self.decode.prefill(self.model, chunk, state)
        state.prefilled += n
        self.prompt_tokens += n
        if seq.plan is not None:
            seq.plan.after_chunk(seq, n)
        return n

    def _prefill_state(self, seq: Row) -> PrefillState:
        if seq.prefill is None:
            seq.prefill = PrefillState()
        if seq.prefill.backbone is None:
            seq.prefill.backbone = self.model.make_cache()
        return seq.prefill

    def _join(self, seq: Row) -> None:
        state = self._prefill_state(seq)
        self.prefilling.remove(seq)
        if seq.req.share is not None:
            seq.req.share.joined(seq, state)
            self.shared_prefill_rows += seq.shared_prefill
        seq.decode = self.decode.join(state, seq.req.prompt_ids)
        self.batch.insert(seq, state)
        seq.prefill = None
        if seq.req.on_joined is not None:  # e.g. admission giving back the prefill working set
            try:
                seq.req.on_joined()
            except Exception:
                logger.exception("on_joined callback of %s failed", seq.rid)

    def _decode(self) -> list[TextOutput]:
        rows = self.running
        self.batch_size_histogram[len(rows)] = self.batch_size_histogram.get(len(rows), 0) + 1
        try:
            result = self.decode.step(
                self.model, self.cache, [s.next_input for s in rows], [s.sampler for s in rows]
            )
        except Exception as e:  # the batch's caches may be half-updated: every row is affected
            logger.exception("decode step failed; failing %d running requests", len(rows))
            self.batch.clear()
            return [s.output("error", error=f"{type(e).__name__}: {e}") for s in rows]
        outputs, finished = [], []
        for i, (seq, tokens) in enumerate(zip(rows, result.tokens)):
            before = len(seq.token_ids)
            if result.drafted:
                seq.drafted += result.drafted[i]
                seq.accepted += result.accepted[i]
            try:  # a fault of this row alone (its sampling, its stop handling) fails this row alone
                if seq.sampler.fault is not None:
                    raise seq.sampler.fault
                seq.add_tokens(tokens, result.logprobs[i] if result.logprobs else None)
                out = seq.output()
            except Exception as e:
                seq.finish_reason = "error"
                out = row_check.error_output(seq, e)
            self.generated_tokens += len(seq.token_ids) - before
            outputs.append(out)
            if seq.finish_reason:
                finished.append(seq)
                if self.prefix_cache is not None:
                    SnapshotPlan.after_generation(self.prefix_cache, seq, self.cache, i)
        if finished:
            self._drop_rows(finished)
        return outputs

    def _drop_rows(self, gone: list[Row]) -> None:
        self.batch.filter([s for s in self.running if s not in gone])
        if not self.running:
            mx.clear_cache()

    def fail_all(self, error: BaseException) -> list[TextOutput]:
        """Finish every request with an error (last resort after an unexpected fault)."""
        seqs = [*self.running, *self.prefilling, *self.waiting]
        self.prefilling = []
        self.waiting.clear()
        self.batch.clear()
        return [s.output("error", error=f"{type(error).__name__}: {error}") for s in seqs]

    def memory_model(self) -> MemoryModel:
        """What this engine allocates per request (ask it for admission's projection)."""
        return engine_memory_model(
            self.model,
            prefill_step_size=self.prefill_step_size,
            head_layers=self.decode.head_layers,
            draft_tokens=getattr(self.decode, "k", 0) if self.decode.head_layers else 0,
        )

    def counts(self) -> dict[str, int]:
        return {"running": len(self.running), "prefilling": len(self.prefilling), "waiting": len(self.waiting)}

    def stats(self) -> dict[str, Any]:
        return {
            **self.counts(),
            "steps": self.steps,
            "prompt_tokens_processed": self.prompt_tokens,
            "shared_prefill_rows": self.shared_prefill_rows,
            "tokens_generated": self.generated_tokens,
            "batch_size_histogram": dict(sorted(self.batch_size_histogram.items())),
            "slowest_steps": self.profile.slowest(),
            "garbage_collector": gc_pauses.stats(),
            "cache_bytes": self.batch.nbytes,
            **dict(zip(("kv_bytes", "kv_used_bytes"), self.batch.kv_bytes())),
            "prefix_cache_bytes": self.prefix_cache.nbytes if self.prefix_cache is not None else 0,
            **({"mtp": self.decode.stats()} if hasattr(self.decode, "stats") else {}),
        }
