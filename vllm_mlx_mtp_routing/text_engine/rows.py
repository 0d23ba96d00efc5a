"""One owner per row: a request's state in the scheduler, and the batch that holds the rows.

A ``Row`` is everything the engine keeps for one request: its sampler and stop rules, the tokens
it produced, its prefill-stage caches (``PrefillState``) until it joins, and afterwards its decode
strategy's per-row state (``Row.decode``). Its place in every batch cache is its index in
``DecodeBatch.rows``: the backbone's ``BatchCache`` rows and the MTP head's ``RaggedKVCache`` rows
follow that list, and only ``DecodeBatch`` changes it (``insert``, ``filter``, ``clear``), so the
caches cannot drift out of step with the rows.

Rows whose caches come from elsewhere (a prefix-cache snapshot, a sparse prefill) enter through
``BatchScheduler.add(request, restored=PrefillState(...))``: the state is validated there, the
rest of the prompt (if any) is prefilled on it in the usual chunks, and the row joins the batch
like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from ..model.mlx_lm_internals import KVCache

from .batch_cache import BatchCache, RaggedKVCache
from .head_cache import PositionedKVCache
from .detokenize import StopText
from .logits_processing import RowLogits
from .logprobs import TokenLogprob
from .outputs import TextOutput
from .sampling import RowSampler, SamplingOptions
from .shared_prefill import SharedPrefill


@dataclass
class TextRequest:
    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions = field(default_factory=SamplingOptions)
    # Prompt positions worth a prefix-cache snapshot, with their kind ("system", "message"); the
    # end of the prompt is always one. Used only with a prefix cache.
    snapshot_at: list[tuple[int, str]] = field(default_factory=list)
    # Called once when the request's prefill is done and it joins the decode batch.
    on_joined: Callable[[], None] | None = None
    # One of the n rows of a request (OpenAI ``n``): the rows prefill once (shared_prefill.py).
    share: SharedPrefill | None = None
    # The request's own SpecPrefill fields (a ``specprefill.settings.RequestChoice``; None: the server's).
    specprefill: Any = None


@dataclass
class PrefillState:
    """A request's caches before it joins the batch: single-sequence (batch 1) mlx-lm caches.

    - ``backbone``: the layout of ``model.make_cache()`` (``KVCache`` for attention layers,
      ``ArraysCache`` [conv, recurrent] for gated-delta layers) holding ``prompt[:prefilled]``.
    - ``head``: the MTP head's caches (``MTPHead.make_cache()``: one ``KVCache`` per head layer)
      holding the pairs (hidden_t, token_t+1) for t < prefilled - 1, i.e. prefilled - 1 entries.
      None: the head starts empty at that position (it skips the missing positions; drafts are
      still verified, so only acceptance can suffer). A head that started past 0 (its window of
      the prompt, or after a restore without it) holds ``PositionedKVCache``s from there.
    - ``head_hidden``: [1, 1, H], the backbone's hidden state at position prefilled - 1 (what the
      MTP head reads: post-norm unless the config says pre_norm); its pair waits for the next
      token. None: that pair is skipped too.
    - ``prefilled``: prompt tokens already in ``backbone``; at most len(prompt) - 1, since the
      last prompt token is fed by the row's first decode step.
    - ``position``: the RoPE position of the next token when it differs from the keys held (a
      sparse prefill keeps fewer keys than the positions it covered; ``prefilled`` then counts the
      prompt tokens covered and must be len(prompt) - 1); None: the keys held, ``prefilled``.
    """

    backbone: list[Any] | None = None
    head: list[Any] | None = None
    head_hidden: mx.array | None = None
    prefilled: int = 0
    position: int | None = None
    prefill_to: int | None = None  # len(prompt) - 1, set by the scheduler: where the prefill ends

    @property
    def next_position(self) -> int:
        return self.prefilled if self.position is None else self.position

    def check(self, prompt_len: int) -> None:
        """Raise ValueError unless this state can start a request with a prompt of this length."""
        if not 0 <= self.prefilled <= prompt_len - 1:
            raise ValueError(f"prefilled={self.prefilled} must be in [0, {prompt_len - 1}] (the last prompt token is decoded)")
        if self.prefilled and self.backbone is None:
            raise ValueError("prefilled > 0 needs the backbone caches")
        if self.backbone is not None:
            kv = next((c for c in self.backbone if isinstance(c, KVCache)), None)
            held = 0 if kv is None or kv.keys is None else kv.offset
            if self.position is None and held != self.prefilled:
                raise ValueError(f"backbone caches hold {held} tokens, prefilled says {self.prefilled}")
            if self.position is not None and held > self.prefilled:
                raise ValueError(f"backbone caches hold {held} tokens, more than the {self.prefilled} covered")
        if self.position is not None:
            if self.position < self.prefilled:
                raise ValueError("position must be >= prefilled")
            # mlx-lm's single-sequence caches rotate by the keys they hold, not by ``position``: a
            # sparse state cannot be prefilled further, so it must cover all but the last token.
            if self.prefilled != prompt_len - 1:
                raise ValueError("a sparse state (position set) must cover the prompt but its last token")


class Row:
    """A request while the scheduler holds it (waiting, prefilling or in the decode batch)."""

    def __init__(self, req: TextRequest, tokenizer: Any, eos_ids: set[int], restored: PrefillState | None = None) -> None:
        self.req = req
        self.rid = req.request_id
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if req.options.logprobs else None  # one per token_ids entry
        self.stop_ids = eos_ids | set(req.options.stop_token_ids)
        self.sampler = RowSampler(req.options)
        self.sampler.logits = RowLogits.for_row(req.options, req.prompt_ids, self.token_ids, self.stop_ids)
        self.text = StopText(tokenizer, req.options.stop)
        self.prefill: PrefillState | None = restored  # the prefill-stage caches until the row joins
        self.decode: Any = None  # the decode strategy's per-row state once the row is in the batch
        self.next_input = req.prompt_ids[-1]
        self.finish_reason: str | None = None
        self.emitted_text = ""
        self.emitted_tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.plan: Any = None  # the prefix-cache plan (lookup done, snapshot positions) once prefilling
        self.sparse: Any = None  # a SpecPrefill job while the row is scored and prefilled sparsely
        self.specprefill_outcome: dict | None = None  # SpecPrefill's decision, reported with the outputs
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache
        self.shared_prefill = False  # started from the prefill of another row of its request

    @property
    def prefilled(self) -> int:
        return 0 if self.prefill is None else self.prefill.prefilled

    @property
    def to_prefill(self) -> int:
        return len(self.req.prompt_ids) - 1

    def add_tokens(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append generated tokens (and their log-probabilities), stopping at the first stop token/string
        or at max_tokens."""
        for n, t in enumerate(tokens):
            self.token_ids.append(t)
            if self.logprobs is not None and logprobs:
                self.logprobs.append(logprobs[n])
            if t in self.stop_ids:
                self.finish_reason = "stop"
            elif self.text.add(t):
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.req.options.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                return
        self.next_input = tokens[-1]

    def output(self, finish_reason: str | None = None, error: str | None = None) -> TextOutput:
        reason = finish_reason or self.finish_reason
        if reason in ("stop", "length"):
            self.text.finish()
        new_text = self.text.take_new(final=reason is not None)
        self.emitted_text += new_text
        new_ids = self.token_ids[self.emitted_tokens :]
        self.emitted_tokens = len(self.token_ids)
        return TextOutput(
            request_id=self.rid,
            new_text=new_text,
            text=self.emitted_text,
            new_token_ids=new_ids,
            token_ids=list(self.token_ids),
            prompt_tokens=len(self.req.prompt_ids),
            completion_tokens=len(self.token_ids),
            finished=reason is not None,
            finish_reason=reason,
            mtp_drafted=self.drafted,
            mtp_accepted=self.accepted,
            cached_tokens=self.cached_tokens,
            error=error,
            logprobs=self.logprobs[len(self.token_ids) - len(new_ids) :] if self.logprobs is not None else None,
            specprefill=self.specprefill_outcome,
        )


class DecodeBatch:
    """The decode batch: its rows and every batch cache, row i of each cache being ``rows[i]``.

    ``backbone``: the model's per-layer batch caches; ``head``: the MTP head's attention caches (one
    ``RaggedKVCache`` per head layer; empty without a head). ``version`` changes whenever rows join
    or leave (a strategy timing steps uses it to skip the first step after a change).
    """

    def __init__(self, model: nn.Module, head_layers: int = 0) -> None:
        self._model = model
        self._head_layers = head_layers
        self.rows: list[Row] = []
        self.backbone = BatchCache(model)
        self.head: list[RaggedKVCache] = [RaggedKVCache() for _ in range(head_layers)]
        self.version = 0

    def __len__(self) -> int:
        return len(self.rows)

    def insert(self, row: Row, state: PrefillState) -> None:
        """Append ``row`` with its single-sequence caches as the last row of every batch cache."""
        backbone = state.backbone if state.backbone is not None else self._model.make_cache()
        kv = next((c for c in backbone if isinstance(c, KVCache)), None)
        held = 0 if kv is None or kv.keys is None else kv.offset
        self.backbone.add_row(backbone, shift=state.next_position - held)
        if self.head:
            head = state.head if state.head is not None else [KVCache() for _ in self.head]
            if len(head) != len(self.head):
                raise ValueError(f"{len(head)} head caches for a head of {len(self.head)} layers")
            for c, rc in zip(self.head, head):  # a head that started past 0 skips the positions before
                c.add_row(rc.held(), rc.start) if isinstance(rc, PositionedKVCache) else c.add_row(rc)
        self.rows.append(row)
        self.version += 1

    def filter(self, keep: list[Row]) -> None:
        """Keep only these rows, in this order, in the row list and every cache."""
        index = {id(r): i for i, r in enumerate(self.rows)}
        idx = [index[id(r)] for r in keep]
        self.backbone.filter(idx)
        for c in self.head:
            c.filter(idx)
        self.rows = list(keep)
        self.version += 1

    def clear(self) -> None:
        """Drop every row (after a fault that may have left the caches half-updated)."""
        self.rows = []
        self.backbone = BatchCache(self._model)
        self.head = [RaggedKVCache() for _ in range(self._head_layers)]
        self.version += 1

    @property
    def nbytes(self) -> int:
        return self.backbone.nbytes + sum(c.nbytes for c in self.head)

    def kv_bytes(self) -> tuple[int, int]:
        """(held, owned by rows) bytes of attention KV, backbone and head (held counts free blocks)."""
        caches = [c for c in self.backbone.layers if isinstance(c, RaggedKVCache)] + self.head
        return sum(c.nbytes for c in caches), sum(c.used_bytes for c in caches)
