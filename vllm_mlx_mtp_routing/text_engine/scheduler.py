"""The scheduler: plans each step of the continuous batch (admission, chunked prefill, joins, the decode, leaves)
and keeps every request's bookkeeping; the model runner (runner.py) executes what it plans.

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
from collections.abc import Callable
from typing import Any, Protocol

import mlx.nn as nn

from .. import gc_pauses
from ..admission.memory_model import MemoryModel
from ..model.media_forward import VisionParts
from ..prefix_cache.cache import PrefixCache
from ..prefix_cache.plan import SnapshotPlan
from ..specprefill.pipeline import SpecPrefill
from . import prefill_budget, row_check
from .batch_cache import BatchCache
from .decode_batch import DecodeBatch
from .detokenize import eos_ids_of
from .footprint import engine_memory_model
from .prefill_budget import ChunkGrid
from .prefill_order import prefill_order
from .row import Row
from .runner import ModelRunner
from .spec.mtp import MTPDecode
from .state import MediaInput, PrefillState, TextOutput, TextRequest
from .step_plan import DecodePlan, DecodeResult, MediaEncode, PrefillChunk, PrefillWork, SparsePiece
from .step_profile import StepProfile, StepRecord

logger = logging.getLogger(__name__)


class LayerPieces(Protocol):
    """How many of a chunk's layers one step runs while rows decode (prefill_budget.PrefillBudget)."""

    def piece_end(self, position: int, tokens: int, first: int, scale: float = 1.0, spent_s: float = 0.0) -> int: ...

    def piece_s(self, position: int, tokens: int, first: int, end: int) -> float: ...


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
        decode: MTPDecode | None = None,
        prefix_cache: PrefixCache | None = None,
        specprefill: SpecPrefill | None = None,
        vision: VisionParts | None = None,
    ) -> None:
        """``decode``: MTP speculative decoding (None: one token per row per step); ``prefix_cache``: None
        prefills every prompt in full; ``specprefill``: None prefills every prompt densely; ``vision``: the VLM's
        vision tower and positions, for media rows (None: text rows only)."""
        if max_num_seqs < 1 or prefill_step_size < 1:
            raise ValueError("max_num_seqs and prefill_step_size must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.prefill_step_size = prefill_step_size
        self.prefill_chunk = prefill_step_size  # tokens per prefill forward; prefill_budget may lower it
        self.chunk_grid: ChunkGrid | None = None  # chunks that shrink with the position (prefill_budget); None: fixed
        # Chunks while no row decodes, where chunking is exact: (position, seconds a token of the last chunk) -> tokens.
        self.idle_chunk: Callable[[int, float], int] | None = None
        # While rows decode, a chunk runs in pieces of layers, sized by this projection (prefill_budget).
        self.layer_pieces: LayerPieces | None = None
        # Measured over projected seconds of recent pieces: a calibration read on a loaded machine, or an attention
        # cost it missed, corrects itself from the next piece on (any split of a chunk's layers is exact).
        self._piece_scale = 1.0
        self._head_waited = False  # short prompts passed the queue's head last step, which made no progress (prefill_order)
        self.prompts_passed = 0  # short prompts that were prefilled ahead of a long one under way
        self.layers = len(getattr(getattr(model, "model", None), "layers", ())) or 1
        self._last_chunk_rate = 0.0  # CPU seconds per token of the last dense chunk, while no row decodes
        self.prefill_time_s: tuple[float, float] | None = None  # (x decode step, idle seconds); see prefill_budget
        self.decode_step_s = 0.0
        self.eos_ids = eos_ids_of(tokenizer) | set(eos_token_ids or ())
        self.spec = decode
        self.prefix_cache = prefix_cache
        self.specprefill = specprefill
        self.runner = ModelRunner(model, decode, vision)
        self.media_rows = 0  # media requests that joined the batch
        self.images_encoded = 0
        self.vision_pieces = 0  # vision-tower items that ran part of an image's blocks (while rows decoded)
        self.waiting: deque[Row] = deque()
        self.prefilling: list[Row] = []
        self.steps = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.shared_prefill_rows = 0  # rows that started from another row's prefill (OpenAI n)
        self.batch_size_histogram: dict[int, int] = {}
        self.profile = StepProfile()
        self._after_delivery: list[Callable[[], None]] = []  # snapshots taken after delivery (finish_delivered)

    @property
    def batch(self) -> DecodeBatch:
        """The decode batch (the runner's): its rows and every batch cache."""
        return self.runner.batch

    @property
    def running(self) -> list[Row]:
        """The decode batch's rows, in cache row order."""
        return self.runner.batch.rows

    @property
    def cache(self) -> BatchCache:
        """The backbone's batch caches."""
        return self.runner.cache

    @property
    def head_layers(self) -> int:
        return self.spec.head_layers if self.spec is not None else 0

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
        if request.media is not None and self.runner.vision is None:
            raise ValueError("a media request, but this engine serves text only")
        self.waiting.append(Row(request, self.tokenizer, self.eos_ids, restored))

    def abort(self, request_id: str) -> TextOutput | None:
        """Remove a request now (call between steps); its final output, or None if unknown."""
        row = self._find(request_id)
        if row is None:
            return None
        if row in self.running:
            self._drop_rows([row])
        else:
            if row in self.prefilling and row.plan is not None:
                self.runner.rewind(row)  # a chunk stopped between layers: back to its start
                row.plan.after_abort(row)  # a retry resumes where this prefill stopped
            (self.prefilling if row in self.prefilling else self.waiting).remove(row)
            if row.req.share is not None:
                row.req.share.left(row)
        row.prefill = row.sparse = None
        return row.output("abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._after_delivery)

    def finish_delivered(self) -> None:
        """The work that waited until the last step's outputs were delivered (the text engine calls it then; a step
        runs it first): end-of-prompt and end-of-generation snapshots, which no client need wait for."""
        jobs, self._after_delivery = self._after_delivery, []
        for job in jobs:
            job()

    def _find(self, request_id: str) -> Row | None:
        for group in (self.running, self.prefilling, self.waiting):
            for row in group:
                if row.rid == request_id:
                    return row
        return None

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[TextOutput]:
        """Admit, prefill up to one budget, join, decode the batch once; outputs of this step."""
        self.finish_delivered()
        if not (self.waiting or self.prefilling or self.running):
            return []
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
        """Prefill work in queue order (short prompts may pass a long one: prefill_order.py), each item planned once the
        one before it ran, until the step's budget is spent; prefilled rows join as they finish."""
        outputs = []
        done, started, last = 0, time.perf_counter(), 0.0
        rows = list(self.prefilling)
        plain = [r.req.media is None and r.sparse is None and r.req.share is None for r in rows]
        order = [rows[i] for i in prefill_order(rows, plain, self._head_waited)]
        head, head_at = (rows[0], rows[0].prefilled) if rows else (None, 0)
        ahead = [r for r in order[: order.index(head)] if r.prefilled < r.to_prefill] if head is not None else []
        for row in order:
            if row.req.share is not None and not row.req.share.ready(row, self.model, self.head_layers > 0):
                continue  # another row of its request is prefilling the same prompt
            try:
                self._begin_prefill(row)
                while row.prefilled < row.to_prefill:
                    # a later piece of this step is sized to what the budget leaves, and checked by its projection
                    work = self._next_work(row, time.perf_counter() - started if done else 0.0)
                    if done and not prefill_budget.more_prefill(self, done + work.tokens, started,
                                                                self._projected_s(work, last)):
                        break
                    cpu = time.process_time()
                    (ran,) = self.runner.prefill([work])
                    if ran.error is not None:
                        raise ran.error
                    done += ran.tokens
                    last = ran.seconds
                    if isinstance(work, PrefillChunk) and ran.tokens and not self.running:
                        # CPU seconds: other work on the machine must not shrink a lone prompt's chunks
                        self._last_chunk_rate = (time.process_time() - cpu) / ran.tokens
                    record.chunk(ran.tokens, ran.seconds)
                    if isinstance(work, PrefillChunk) and self._pacing() is not None:
                        self._note_piece(work, ran.seconds)
                    elif isinstance(work, MediaEncode) and not work.whole:
                        self._note_encode(work, ran.seconds)
                    self._after_work(work)
            except Exception as e:  # only this request's own caches were touched
                logger.exception("prefill failed for %s", row.rid)
                outputs.append(self._fail_prefill(row, e))
                continue
            if row.prefilled < row.to_prefill:
                break  # budget spent: later requests wait, keeping this step's order
            if done and self.running and row.to_prefill > self.prefill_chunk:
                # A prompt longer than a chunk joins first thing next step, not after this step's prefill: its join,
                # first decode and (at max_tokens 1) leaving would come on top of the prefill budget this step spent.
                # Shorter ones join at once: their joins are cheap, and a burst of them would otherwise take a step each.
                break
            tic = time.perf_counter()
            self._join(row)
            record.joins += 1
            record.join_s += time.perf_counter() - tic
        if head is not None and order[0] is not head:  # short prompts went first (prefill_order)
            for r in ahead:  # each counted once, however many steps its prefill takes
                self.prompts_passed += not r.passed
                r.passed = True
            self._head_waited = head in self.prefilling and head.prefilled == head_at
        else:
            self._head_waited = False
        return outputs

    def _begin_prefill(self, row: Row) -> None:
        """The prefix-cache lookup and the SpecPrefill decision, once, when the row's prefill begins (not at add: a
        prefix the request before it just prefilled counts)."""
        if row.plan is not None:
            return
        row.plan = SnapshotPlan.start(self.prefix_cache, row)
        if self.specprefill is not None and row.req.media is None:  # scored and prefilled sparsely in pieces, see specprefill/
            row.sparse = self.specprefill.start(row, self)

    def _next_work(self, row: Row, spent_s: float = 0.0) -> PrefillWork:
        """The row's next prefill item, sized to the step's budget less ``spent_s`` (its prefill so far)."""
        job = row.sparse if row.sparse is not None and row.sparse.ready() else None
        if job is not None:
            return SparsePiece(row, job, job.next_cost(), overlap=not self.running)
        partial = row.prefill.partial if row.prefill is not None else None
        if partial is not None:  # the chunk under way goes on from the layer it stopped at
            return self._piece(row, partial.start, partial.end, partial.next_layer, spent_s)
        start, end = row.prefilled, row.prefilled + self._chunk_len(row)
        media = row.req.media
        image = media.unencoded(start, end) if media is not None else None
        if media is not None and image is not None:  # its vision features first, one image per item
            return self._encode_piece(row, media, image, spent_s)
        return self._piece(row, start, end, 0, spent_s)

    def _encode_piece(self, row: Row, media: MediaInput, image: int, spent_s: float = 0.0) -> MediaEncode:
        """While rows decode, the image's vision tower a piece per step: its input stage, then as many blocks as the
        step's stall bound leaves room for (the first piece one block, which measures them); otherwise the rest of its
        encode, or all of it."""
        s, e = media.spans[image]
        blocks = self.runner.vision_blocks
        progress = media.encoding.get(image)
        first = progress.next_block if progress is not None else 0
        limit = prefill_budget.step_limit_s(self) or 0.0
        if blocks < 2 or not self.running or limit <= 0:
            return MediaEncode(row, image, e - s, first, None, max(blocks, 1))
        if progress is None:  # the patches embedded and positioned, no block yet
            return MediaEncode(row, image, e - s, 0, 0, blocks)
        per_block = media.block_s.get(image)
        n = 1 if per_block is None else max(1, int(max(limit - spent_s, 0.0) / per_block))
        last = None if first + n >= blocks else first + n
        return MediaEncode(row, image, e - s, first, last, blocks)

    def _pacing(self) -> LayerPieces | None:
        """What sizes a chunk's pieces of layers: the budget while rows decode; None: chunks run whole."""
        return self.layer_pieces if self.running else None

    def _piece(self, row: Row, start: int, end: int, first: int, spent_s: float = 0.0) -> PrefillChunk:
        """While rows decode, as many of the chunk's layers as its stall bound leaves room for; otherwise the rest."""
        last = None
        pieces = self._pacing()
        if pieces is not None:
            stop = pieces.piece_end(start, end - start, first, self._piece_scale, spent_s)
            last = None if stop >= self.layers else stop
        return PrefillChunk(row, start, end, first, last, self.layers)

    def _projected_s(self, work: PrefillWork, last_s: float) -> float:
        """What ``work`` is expected to take while rows decode: a piece of layers or of vision blocks by its measured
        rate; anything else, or with no row decoding, as long as the step's last item took."""
        if not self.running:
            return last_s
        if isinstance(work, PrefillChunk) and self._pacing() is not None:
            return self._piece_scale * self._piece_projection(work)
        media = work.row.req.media
        if isinstance(work, MediaEncode) and media is not None and work.image in media.block_s:
            return media.block_s[work.image] * max(work.stop_block - work.first_block, 1)
        return last_s

    def _piece_projection(self, piece: PrefillChunk) -> float:
        """The budget's projected seconds of a chunk's layers, before the measured rate."""
        assert self.layer_pieces is not None
        return self.layer_pieces.piece_s(piece.start, piece.positions, piece.first_layer, piece.stop_layer)

    def _note_piece(self, piece: PrefillChunk, seconds: float) -> None:
        projected = self._piece_projection(piece)
        if projected > 0:
            ratio = min(max(seconds / projected, 0.1), 100.0)
            # a slower piece moves it halfway, a faster one a fifth: an overrun is a stall, an underrun only a piece more
            keep = 0.5 if ratio > self._piece_scale else 0.8
            self._piece_scale = keep * self._piece_scale + (1 - keep) * ratio

    @staticmethod
    def _note_encode(piece: MediaEncode, seconds: float) -> None:
        """A vision piece's seconds per block: the next piece's size (its input stage alone measures none)."""
        media = piece.row.req.media
        if media is not None and piece.stop_block > piece.first_block:
            media.block_s[piece.image] = seconds / (piece.stop_block - piece.first_block)

    def _chunk_len(self, row: Row) -> int:
        """Chunks end on a grid of positions fixed for the server's life (multiples of the chunk size,
        or ends that draw closer deeper into a prompt; see prefill_budget), never depending on the
        other requests, and at the request's prefix-cache snapshot positions. Where the device's prefill does not
        depend on its chunks (prefill_budget's ``chunk_exact``), a prompt takes large chunks while no row decodes."""
        start = row.prefilled
        grid = self.chunk_grid
        if self.idle_chunk is not None and not self.running:
            end = start + self.idle_chunk(start, self._last_chunk_rate if start else 0.0)
        elif grid is not None:
            end = grid.next_end(start)
        else:
            end = (start // self.prefill_chunk + 1) * self.prefill_chunk
        end = min(end, row.to_prefill)
        return (row.plan.cut(start, end) if row.plan is not None else end) - start

    def _after_work(self, work: PrefillWork) -> None:
        if isinstance(work, MediaEncode):
            self.images_encoded += work.completes
            self.vision_pieces += not work.whole
        elif isinstance(work, PrefillChunk) and work.completes:
            self.prompt_tokens += work.positions
            if work.row.plan is not None:  # a snapshot where the plan wants one (the prompt's end: after delivery)
                later = work.row.plan.after_chunk(work.row, work.positions)
                if later is not None:
                    self._after_delivery.append(later)

    def _fail_prefill(self, row: Row, error: BaseException) -> TextOutput:
        self.prefilling.remove(row)
        row.prefill = row.sparse = None
        if row.req.share is not None:
            row.req.share.left(row)
        return row.output("error", error=f"{type(error).__name__}: {error}")

    def _join(self, row: Row) -> None:
        state = self.runner.prefill_state(row)
        self.prefilling.remove(row)
        if row.req.share is not None:
            row.req.share.joined(row, state)
            self.shared_prefill_rows += row.shared_prefill
        self.runner.join(row)
        self.media_rows += row.req.media is not None
        if row.req.on_joined is not None:  # e.g. admission giving back the prefill working set
            try:
                row.req.on_joined()
            except Exception:
                logger.exception("on_joined callback of %s failed", row.rid)

    def _plan_decode(self, rows: list[Row]) -> DecodePlan:
        if self.spec is None:
            return DecodePlan(rows)
        k, drafting = self.spec.plan(self.batch)
        return DecodePlan(rows, k, drafting)

    def _decode(self) -> list[TextOutput]:
        """One decode step of the batch. A plain step (with MTP, one the draft policy made plain) is launched before the
        previous one's tokens are read (``ModelRunner.decode_ahead``), so it is those that come out here. A step that
        cannot be decoded ahead (drafts, logits processors) first reads the launched step, if any, and then runs
        serially in the same call, as planned for the rows still running: the policy plans each step once."""
        rows = list(self.running)
        self.batch_size_histogram[len(rows)] = self.batch_size_histogram.get(len(rows), 0) + 1
        outputs: list[TextOutput] = []
        try:
            plan = self._plan_decode(rows)
            if self.runner.can_decode_ahead(plan):
                done = self.runner.decode_ahead(plan)
                if done is None:
                    return []
                self._observe(DecodePlan(done[0]), done[1])
                return self._emit(*done)
            settled = self.runner.settle()
            if settled is not None:
                self._observe(DecodePlan(settled[0]), settled[1])
                outputs = self._emit(*settled)
                rows = list(self.running)
                if not rows:
                    return outputs
                plan = self._still_running(plan)
            result = self.runner.decode(plan)
            self._observe(plan, result)
        except Exception as e:  # the batch's caches may be half-updated: every row is affected
            logger.exception("decode step failed; failing %d running requests", len(rows))
            self.runner.clear()
            return outputs + [r.output("error", error=f"{type(e).__name__}: {e}") for r in rows]
        return outputs + self._emit(rows, result)

    def _still_running(self, plan: DecodePlan) -> DecodePlan:
        """``plan`` for the rows still running after the launched step was read (the batch's order): rows that finished
        are gone, and a row that can no longer draft (now at its last token) does not."""
        rows = list(self.running)
        if self.spec is None:
            return DecodePlan(rows)
        was = {id(r): d for r, d in zip(plan.rows, plan.drafting)}
        drafting = [was.get(id(r), False) and self.spec.can_draft(r) for r in rows]
        return DecodePlan(rows, plan.draft_tokens if any(drafting) else 0, drafting)

    def _emit(self, rows: list[Row], result: DecodeResult) -> list[TextOutput]:
        """The rows' tokens of one decode step: their outputs; rows that finished leave the batch."""
        outputs, finished = [], []
        for i, (row, tokens) in enumerate(zip(rows, result.tokens)):
            before = len(row.token_ids)
            if result.drafted:
                row.drafted += result.drafted[i]
                row.accepted += result.accepted[i]
            try:  # a fault of this row alone (its sampling, its stop handling) fails this row alone
                if row.sampler.fault is not None:
                    raise row.sampler.fault
                row.add_tokens(tokens, result.logprobs[i] if result.logprobs else None)
                out = row.output()
            except Exception as e:
                row.finish_reason = "error"
                out = row_check.error_output(row, e)
            self.generated_tokens += len(row.token_ids) - before
            outputs.append(out)
            if row.finish_reason:
                finished.append(row)
                if self.prefix_cache is not None:
                    save = SnapshotPlan.after_generation(self.prefix_cache, row, self.cache, self.running.index(row))
                    if save is not None:
                        self._after_delivery.append(save)
        if finished:
            self._drop_rows(finished)
        return outputs

    def _observe(self, plan: DecodePlan, result: DecodeResult) -> None:
        if self.spec is not None:
            self.spec.observe(self.batch, plan, result)

    def _drop_rows(self, gone: list[Row]) -> None:
        self.runner.keep([r for r in self.running if r not in gone])

    def fail_all(self, error: BaseException) -> list[TextOutput]:
        """Finish every request with an error (last resort after an unexpected fault)."""
        rows = [*self.running, *self.prefilling, *self.waiting]
        self.prefilling = []
        self.waiting.clear()
        self.runner.clear()
        return [r.output("error", error=f"{type(error).__name__}: {error}") for r in rows]

    def memory_model(self) -> MemoryModel:
        """What this engine allocates per request (ask it for admission's projection)."""
        return engine_memory_model(
            self.model,
            prefill_step_size=self.prefill_step_size,
            head_layers=self.head_layers,
            draft_tokens=self.spec.k if self.spec is not None else 0,
        )

    def counts(self) -> dict[str, int]:
        return {"running": len(self.running), "prefilling": len(self.prefilling), "waiting": len(self.waiting)}

    def stats(self) -> dict[str, Any]:
        return {
            **self.counts(),
            "steps": self.steps,
            "prompt_tokens_processed": self.prompt_tokens,
            "shared_prefill_rows": self.shared_prefill_rows,
            "media_rows": self.media_rows,
            "images_encoded": self.images_encoded,
            "vision_pieces": self.vision_pieces,
            "prompts_passed": self.prompts_passed,
            "tokens_generated": self.generated_tokens,
            "batch_size_histogram": dict(sorted(self.batch_size_histogram.items())),
            "slowest_steps": self.profile.slowest(),
            "garbage_collector": gc_pauses.stats(),
            "cache_bytes": self.batch.nbytes,
            **dict(zip(("kv_bytes", "kv_used_bytes"), self.batch.kv_bytes())),
            "prefix_cache_bytes": self.prefix_cache.nbytes if self.prefix_cache is not None else 0,
            **({"mtp": self.spec.stats()} if self.spec is not None else {}),
        }
