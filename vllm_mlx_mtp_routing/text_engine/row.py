"""A request while the scheduler holds it: its sampler and stop rules, its tokens, its caches until it joins."""

from __future__ import annotations

from typing import Any

from .detokenize import StopText
from .logits_processing import RowLogits
from .logprobs import TokenLogprob
from .sampling import RowSampler
from .spec.mtp_rows import MTPRowState
from .state import PrefillState, PrefixPlan, SparseJobView, TextOutput, TextRequest


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
        self.spec: MTPRowState | None = None  # its MTP state once it is in the batch (with MTP)
        self.next_input = req.prompt_ids[-1]
        self.finish_reason: str | None = None
        self.emitted_text = ""
        self.emitted_tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.plan: PrefixPlan | None = None  # the prefix-cache plan (lookup done, snapshot positions) once prefilling
        self.sparse: SparseJobView | None = None  # a SpecPrefill job while the row is scored and prefilled sparsely
        self.specprefill_outcome: dict | None = None  # SpecPrefill's decision, reported with the outputs
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache
        self.shared_prefill = False  # started from the prefill of another row of its request
        self.passed = False  # prefilled ahead of a long prompt under way (prefill_order.py)

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


