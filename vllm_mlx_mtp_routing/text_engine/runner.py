"""The model runner: executes what the scheduler planned. The only part of the engine that calls the model.

It owns the decode batch (its rows and every batch cache) and runs three kinds of work:

- prefill items (``PrefillChunk``, ``SparsePiece``) on a row's own single-sequence caches (``PrefillState``), so
  neither padding nor other prompts ever enter a prompt's forward passes;
- joins: a prefilled row's caches become the batch's last row (per-row KV lengths and RoPE offsets, per-row
  gated-delta state), its first decode step feeding its last prompt token;
- a decode step of the whole batch: one [B, 1] forward and a sample per row, or with MTP the proposer's drafts, one
  verify forward, acceptance and the rollback of what was rejected (spec/).

Where a step ends in ``mx.async_eval`` (the MTP rollback) the device runs on while the scheduler does its
bookkeeping; the plan/execute boundary is where a next step's planning can overlap the device's work.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from ..model import layered_forward
from ..model.backbone import backbone_forward
from ..model.kernels.device import kind
from ..model.media_forward import VisionParts
from .batch_cache import BatchCache
from .decode_batch import DecodeBatch
from .logprobs import row_logprobs
from .row import Row
from .sampling import RowSampler, sample_rows
from .spec import verify
from .spec.mtp import MTPDecode
from .spec.mtp_rows import MTPRowState
from .spec.proposer import MTPProposer
from .state import MediaInput, PrefillState
from .step_plan import DecodePlan, DecodeResult, MediaEncode, PrefillChunk, PrefillDone, PrefillWork


def prefill_forward(model: nn.Module, proposer: MTPProposer | None, tokens: mx.array, state: PrefillState) -> None:
    """One prefill chunk ([1, n]) on a request's own caches (``state.backbone``; with MTP the head's pairs too),
    from ``state.prefilled`` on, which it advances."""
    assert state.backbone is not None  # ModelRunner.prefill_state makes it
    if proposer is None or not proposer.wants_prefill_hidden(state, state.prefilled + tokens.shape[1]):
        # mlx-lm's own forward: nothing reads the last layer's output, so it is never computed.
        model(tokens, cache=state.backbone)
        if proposer is not None:
            proposer.skip_prefill_chunk(state)
        mx.eval([c.state for c in state.backbone])
    else:
        _, hidden, _ = backbone_forward(model, tokens, state.backbone, hidden_state_mode=proposer.hidden_state_mode,
                                        logits=False)
        mx.eval([c.state for c in state.backbone], proposer.prefill(hidden, tokens, state, state.prefilled))
    state.prefilled += tokens.shape[1]


def media_embeddings(model: nn.Module, media: MediaInput, tokens: mx.array, start: int) -> mx.array:
    """The input embeddings of ``tokens`` (a media prompt's from ``start``): each image's features in place of its
    tokens."""
    end = start + tokens.shape[1]
    embedded = model.model.embed_tokens(tokens)
    pieces, at = [], start
    for j, (s, e) in enumerate(media.spans):
        if s >= end or e <= start:
            continue
        lo, hi = max(s, start), min(e, end)
        pieces += [embedded[:, at - start : lo - start], media.features[j][None, lo - s : hi - s].astype(embedded.dtype)]
        at = hi
    return mx.concatenate([*pieces, embedded[:, at - start :]], axis=1) if pieces else embedded


def _release_features(media: MediaInput, end: int) -> None:
    for j, (_, e) in enumerate(media.spans):  # an image wholly prefilled needs its features no more
        if e <= end:
            media.features.pop(j, None)


def layered_prefill(
    model: nn.Module, vision: VisionParts | None, proposer: MTPProposer | None, prompt_ids: list[int],
    media: MediaInput | None, chunk: PrefillChunk, state: PrefillState,
) -> None:
    """Layers ``chunk.first_layer`` up to ``chunk.last_layer`` of a chunk's forward (model/layered_forward.py); the
    piece that runs the last layer finishes the chunk as ``prefill_forward`` does. A media chunk (its embeddings with
    each image's features in place of its tokens, at the VLM's M-RoPE positions) always runs here, whole or in pieces."""
    assert state.backbone is not None  # ModelRunner.prefill_state makes it
    layers = len(model.model.layers)
    stop = layers if chunk.last_layer is None else min(chunk.last_layer, layers)
    progress = state.partial
    if progress is None:
        if chunk.first_layer != 0:
            raise RuntimeError(f"a piece from layer {chunk.first_layer}, but no chunk is under way")
        tokens = mx.array(prompt_ids[chunk.start : chunk.end], dtype=mx.uint32)[None]
        embeddings = position_ids = None
        if media is not None:
            assert media.position_ids is not None  # made by the runner
            embeddings = media_embeddings(model, media, tokens, chunk.start)
            position_ids = media.position_ids[:, :, chunk.start : chunk.end]
        progress = layered_forward.begin(model, chunk.start, tokens, state.backbone, embeddings, position_ids)
    elif (progress.start, progress.end, progress.next_layer) != (chunk.start, chunk.end, chunk.first_layer):
        raise RuntimeError(f"a piece of [{chunk.start}, {chunk.end}) from layer {chunk.first_layer}, but the chunk under "
                           f"way is [{progress.start}, {progress.end}) at layer {progress.next_layer}")
    layered_forward.run_layers(model, progress, state.backbone, stop, vision.rotaries if vision is not None else None)
    if stop < layers:
        state.partial = progress
        mx.eval(progress.hidden, [state.backbone[i].state for i in range(chunk.first_layer, stop)])
        return
    state.partial = None
    arrays: list = [c.state for c in state.backbone]
    if proposer is not None:
        if proposer.wants_prefill_hidden(state, chunk.end):
            hidden = layered_forward.head_input(model, progress, proposer.hidden_state_mode)
            arrays.append(proposer.prefill(hidden, progress.tokens, state, chunk.start))
        else:
            proposer.skip_prefill_chunk(state)
    mx.eval(arrays)
    state.prefilled = chunk.end
    if media is not None:
        _release_features(media, chunk.end)


@dataclass
class _Launched:
    """A plain decode step launched and not yet read: its rows, their sampled tokens and logits (on the device), and
    with MTP the hidden states the head's pairs take."""

    rows: list[Row]
    sampled: mx.array  # [B]
    logits: mx.array  # [B, V]
    samplers: list[RowSampler]
    read: bool = False  # its tokens were read when it was launched (see decode_ahead)
    hidden: mx.array | None = None  # [B, 1, H] with MTP

    def take(self, keep: list[int]) -> _Launched | None:
        if not keep:
            return None
        idx = mx.array(keep, dtype=mx.int32)
        rows, samplers = [self.rows[i] for i in keep], [self.samplers[i] for i in keep]
        hidden = self.hidden[idx] if self.hidden is not None else None
        return _Launched(rows, self.sampled[idx], self.logits[idx], samplers, self.read, hidden)


# Measured on CUDA (ahead at batch 8) and the CPU (neutral): docs/benchmarks.md, "Decode loops"; Metal is unmeasured.
VERIFY_LAUNCH_LAYERS = {"cuda": 2, "cpu": 2}


class ModelRunner:
    # An MTP step's drafts and verify start on the device as soon as each graph is built (False: at the acceptance's
    # read, as before; benchmarks compare the two).
    launch_early = True

    def __init__(self, model: nn.Module, spec: MTPDecode | None = None, vision: VisionParts | None = None) -> None:
        self.model = model
        self.spec = spec
        self.vision = vision  # media rows' vision tower and positions (None: text rows only)
        self.vision_in_pieces = True  # while rows decode, an image's tower a piece of its blocks per step (A/B: False)
        self.batch = DecodeBatch(model, head_layers=spec.head_layers if spec is not None else 0)
        self._launched: _Launched | None = None  # the plain step decode_ahead launched last
        # With launch_early, the verify's layers also start every this many layers while the rest of its graph is built
        # (0: all at once), so the device trails the launches and less of its time is waited for at the acceptance.
        self.launch_layers = VERIFY_LAUNCH_LAYERS.get(kind(), 0)

    @property
    def cache(self) -> BatchCache:
        return self.batch.backbone

    # -- prefill -------------------------------------------------------------------------------

    def prefill(self, work: Sequence[PrefillWork]) -> list[PrefillDone]:
        """Run prefill items in order; an item that raises fails its row, whose later items are skipped."""
        done: list[PrefillDone] = []
        failed: set[int] = set()
        for item in work:
            if id(item.row) in failed:
                done.append(PrefillDone(0, 0.0))
                continue
            tic = time.perf_counter()
            try:
                if isinstance(item, PrefillChunk):
                    tokens = self._chunk(item)
                elif isinstance(item, MediaEncode):
                    tokens = self._encode(item)
                else:
                    tokens = item.job.advance(item.overlap)
            except Exception as e:  # only this row's own caches were touched
                failed.add(id(item.row))
                done.append(PrefillDone(0, time.perf_counter() - tic, e))
                continue
            done.append(PrefillDone(tokens, time.perf_counter() - tic))
        return done

    def prefill_state(self, row: Row) -> PrefillState:
        """The row's prefill-stage caches, made on first use."""
        if row.prefill is None:
            row.prefill = PrefillState()
        if row.prefill.backbone is None:
            row.prefill.backbone = self.model.make_cache()
        return row.prefill

    def _chunk(self, chunk: PrefillChunk) -> int:
        row = chunk.row
        state = self.prefill_state(row)
        state.prefill_to = row.to_prefill
        if state.prefilled != chunk.start:
            raise RuntimeError(f"chunk starts at {chunk.start}, the row's caches hold {state.prefilled}")
        proposer = self.spec.proposer if self.spec is not None else None
        media = row.req.media
        if media is not None:
            self._positions(row.req.prompt_ids, media)
        if media is not None or not chunk.whole or state.partial is not None:
            layered_prefill(self.model, self.vision, proposer, row.req.prompt_ids, media, chunk, state)
            return chunk.tokens
        tokens = mx.array(row.req.prompt_ids[chunk.start : chunk.end], dtype=mx.uint32)[None]
        prefill_forward(self.model, proposer, tokens, state)
        return chunk.tokens

    def rewind(self, row: Row) -> None:
        """Undo the layers a chunk under way has run (the row is leaving mid-chunk): its caches end on a chunk end."""
        state = row.prefill
        if state is not None and state.partial is not None:
            assert state.backbone is not None
            layered_forward.rewind(state.partial, state.backbone)
            state.partial = None

    def _encode(self, item: MediaEncode) -> int:
        """The vision tower over one image of a media row, whole or a piece of its blocks; once it is done, its features
        wait for the chunks that cover its tokens."""
        media = item.row.req.media
        vision = self.vision
        if media is None or vision is None:
            raise RuntimeError("a media item for a row without media, or a runner without the vision tower")
        s, e = media.patch_rows(item.image)
        progress = media.encoding.pop(item.image, None)  # an encode under way goes on (its input stage may be all)
        if progress is None and item.whole:
            features = vision.encode(media.pixel_values[s:e], media.grid_thw[item.image])
        else:
            if progress is None:
                if item.first_block != 0:
                    raise RuntimeError(f"a piece from block {item.first_block}, but image {item.image}'s encode has not begun")
                progress = vision.begin_encode(media.pixel_values[s:e], media.grid_thw[item.image])
            elif progress.next_block != item.first_block:
                raise RuntimeError(f"a piece from block {item.first_block}, but image {item.image}'s encode is at block "
                                   f"{progress.next_block}")
            vision.run_blocks(progress, item.stop_block)
            if not item.completes:
                media.encoding[item.image] = progress
                mx.eval(progress.hidden)
                return item.tokens
            features = vision.finish_encode(progress)
        start, end = media.spans[item.image]
        if features.shape[0] != end - start:
            raise ValueError(f"image {item.image} gives {features.shape[0]} features for {end - start} prompt tokens")
        mx.eval(features)
        media.features[item.image] = features
        return item.tokens

    @property
    def vision_blocks(self) -> int:
        """The vision tower's blocks where an image may be encoded in pieces of them, else 0."""
        return self.vision.blocks if self.vision is not None and self.vision_in_pieces else 0

    def _positions(self, prompt_ids: list[int], media: MediaInput) -> None:
        if self.vision is None:
            raise RuntimeError("a media row, but the runner has no vision tower")
        if media.position_ids is None:
            media.position_ids, media.rope_delta = self.vision.positions(prompt_ids, media.grid_thw)

    # -- joins and leaves ----------------------------------------------------------------------

    def join(self, row: Row) -> None:
        """A prefilled row becomes the batch's last row; its prefill-stage caches are released."""
        state = self.prefill_state(row)
        if row.req.media is not None:  # its decode positions continue the prompt's M-RoPE positions
            self._positions(row.req.prompt_ids, row.req.media)
            state.rope_delta = row.req.media.rope_delta
        row.spec = self.spec.proposer.join(state, row.req.prompt_ids) if self.spec is not None else None
        self.batch.insert(row, state)
        row.prefill = None

    def keep(self, rows: Sequence[Row]) -> None:
        """Keep only these rows, in this order; with none left the allocator's cache goes back to the device. A launched
        step's tokens of the rows that leave are dropped."""
        if self._launched is not None:
            kept = {id(r) for r in rows}
            self._launched = self._launched.take([i for i, r in enumerate(self._launched.rows) if id(r) in kept])
        self.batch.filter(list(rows))
        if not self.batch.rows:
            mx.clear_cache()

    def clear(self) -> None:
        """Drop every row (after a fault that may have left the batch caches half-updated)."""
        self._launched = None
        self.batch.clear()

    # -- decode --------------------------------------------------------------------------------

    def decode(self, plan: DecodePlan) -> DecodeResult:
        """One decode step of the batch: its rows in ``plan.rows`` order (the batch's own), read before it returns."""
        rows = self._rows(plan)
        if self.spec is None:
            return self._read(self._launch(rows, None))[1]
        samplers = [r.sampler for r in rows]
        x = mx.array([r.next_input for r in rows], dtype=mx.uint32)[:, None]
        return self._speculative(plan, rows, samplers, x)

    def _rows(self, plan: DecodePlan) -> list[Row]:
        rows = list(plan.rows)
        if len(rows) != len(self.batch.rows):
            raise RuntimeError(f"a plan of {len(rows)} rows for a batch of {len(self.batch.rows)}")
        return rows

    def can_decode_ahead(self, plan: DecodePlan) -> bool:
        """A plain step can be launched before the tokens of the one before it are read: a step without drafts (with
        MTP, one its draft policy made plain), and no row whose logits processing reads its generated tokens
        (penalties, processors), which would then be one token short."""
        return not plan.draft_tokens and all(r.sampler.logits is None for r in plan.rows)

    def decode_ahead(self, plan: DecodePlan) -> tuple[list[Row], DecodeResult] | None:
        """Launch the batch's next plain step (``mx.async_eval``), its inputs the tokens the step launched before it
        sampled, still on the device; then read that earlier step: its rows and their tokens (None: none was launched).

        While the device runs the new step the scheduler reads, streams and plans (mlx-lm's ``BatchGenerator`` and the
        host's batch generator pipeline their steps the same way). The arithmetic is the serial step's, so outputs are
        the same. A row that finishes with the earlier step has its token of the new step dropped when it leaves, and
        its caches then hold its last token too (prefix_cache.plan keeps such a row's state as such).

        With no step in flight (the batch was empty, or decoded serially) the step is read at once, so a first token
        waits for no later launch; the next call then launches two steps and reads the first, filling the pipeline."""
        rows = self._rows(plan)
        before = self._launched
        self._launched = launched = self._launch(rows, before)
        if before is None:
            launched.read = True
            return self._read(launched)
        if before.read:
            self._launched = self._launch(rows, launched)
            return self._read(launched)
        return self._read(before)

    def settle(self) -> tuple[list[Row], DecodeResult] | None:
        """Read the step ``decode_ahead`` launched last, launching none (before a serial step)."""
        before, self._launched = self._launched, None
        return self._read(before) if before is not None and not before.read else None

    def _launch(self, rows: list[Row], before: _Launched | None) -> _Launched:
        """A plain step of ``rows`` started on the device (``mx.async_eval``), its inputs from ``before`` where given.
        With MTP it is the verify's forward without drafts, as a serial plain step: its hidden states become the head's
        pending pairs when the step is read."""
        samplers = [r.sampler for r in rows]
        x = self._inputs(rows, before)
        hidden = None
        if self.spec is None:
            logits = self.model(x, cache=self.cache.layers)[:, -1, :]
        else:
            full, hidden, _ = verify.forward(self.model, x, self.cache, hidden_state_mode=self.spec.hidden_state_mode,
                                             capture=False)
            logits = full[:, -1, :]
        sampled = sample_rows(logits, samplers)
        mx.async_eval(sampled, self.cache.state())
        return _Launched(rows, sampled, logits, samplers, hidden=hidden)

    @staticmethod
    def _inputs(rows: list[Row], before: _Launched | None) -> mx.array:
        """[B, 1]: each row's next input, the launched step's token (on the device) where the row was in it."""
        if before is None:
            return mx.array([r.next_input for r in rows], dtype=mx.uint32)[:, None]
        if [id(r) for r in before.rows] == [id(r) for r in rows]:
            return before.sampled.astype(mx.uint32)[:, None]
        at = {id(r): i for i, r in enumerate(before.rows)}
        parts = [before.sampled[at[id(r)] : at[id(r)] + 1].astype(mx.uint32) if id(r) in at
                 else mx.array([r.next_input], dtype=mx.uint32) for r in rows]  # rows that joined since
        return mx.concatenate(parts)[:, None]

    def _read(self, step: _Launched) -> tuple[list[Row], DecodeResult]:
        tokens = [[t] for t in cast("list[int]", step.sampled.tolist())]
        logprobs = row_logprobs(step.logits[:, None], tokens, step.samplers)
        if step.hidden is None:
            return step.rows, DecodeResult(tokens, logprobs=logprobs)
        assert self.spec is not None
        self.spec.proposer.after_verify(cast("list[MTPRowState]", [r.spec for r in step.rows]), step.hidden, tokens)
        none = [0] * len(tokens)  # as a serial plain step under MTP: no row drafted
        return step.rows, DecodeResult(tokens, none, list(none), logprobs)

    def _speculative(self, plan: DecodePlan, rows: list[Row], samplers: list, x: mx.array) -> DecodeResult:
        spec = self.spec
        assert spec is not None
        k, drafting = plan.draft_tokens, plan.drafting
        states = cast("list[MTPRowState]", [r.spec for r in rows])  # every row joined with one (``join``)
        proposal = spec.proposer.propose(k, states, self.batch.head, drafting, samplers) if k else None
        drafts = proposal.drafts if proposal is not None else None
        if drafts is not None and self.launch_early:
            mx.async_eval(drafts)  # the head drafts on the device while the verify's graph is built
        logits, hidden, captured = verify.forward(
            self.model, verify.feed(x, drafts, drafting), self.cache, hidden_state_mode=spec.hidden_state_mode,
            capture=k > 0, launch_every=self.launch_layers if self.launch_early else 0,
        )
        if self.launch_early:
            mx.async_eval(logits)  # the verify runs while the acceptance's graph is built
        tokens, accepted = spec.accept(logits, drafts, proposal.qs if proposal is not None else {}, drafting, samplers, k)
        verify.roll_back(self.cache, captured, tokens, k + 1)
        spec.proposer.after_verify(states, hidden, tokens)
        # Started, not awaited: the rollback runs while the scheduler does its bookkeeping.
        mx.async_eval(self.cache.state(), [c.state for c in self.batch.head])
        return DecodeResult(
            tokens, [k if d else 0 for d in drafting], accepted, row_logprobs(logits, tokens, samplers),
            caught_up=proposal.caught_up if proposal is not None else False,
        )

