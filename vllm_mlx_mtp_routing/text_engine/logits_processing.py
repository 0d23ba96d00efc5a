"""One row's logits before it samples: penalties, then the host's logits processors.

A row's ``RowLogits`` is called once per position whose token the row emits, with the tokens the
row generated before that position: plain decoding calls it once per step; MTP verification calls
it position by position with the row's tokens and the drafts accepted so far, and stops at the
first rejected draft (``processed_acceptance``). A processor therefore sees exactly the calls
plain decoding makes and never a token that is later rolled back, so its state (a JSON grammar, a
thinking budget) needs no snapshot or rollback, whatever its kind.

Penalties, as vLLM and the OpenAI API define them: ``repetition_penalty`` (HF) divides a positive
logit and multiplies a negative one for every token in the prompt or generated so far;
``frequency_penalty`` subtracts ``count * f`` and ``presence_penalty`` subtracts ``p`` once for
every token generated so far. Order as vLLM: repetition, then frequency and presence, then the
host's processors (the host's own batched path also applies penalties first).
"""

from __future__ import annotations

import copy
import enum
import types
from collections import deque
from collections.abc import Sequence, Set
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx
import numpy as np

from .sampling import SamplingOptions


class RowLogits:
    """A row's logits processing; ``generated`` is the row's own list of generated tokens (shared, not copied)."""

    def __init__(
        self, options: SamplingOptions, prompt_ids: list[int], generated: list[int], stop_ids: Set[int] = frozenset()
    ) -> None:
        self.max_tokens = options.max_tokens
        self.stop_ids = stop_ids
        self.processors = list(options.logits_processors)
        self.presence = float(options.presence_penalty)
        self.frequency = float(options.frequency_penalty)
        self.repetition = float(options.repetition_penalty)
        self.generated = generated
        self._prompt_set = np.unique(np.asarray(prompt_ids, dtype=np.int64)) if self.repetition != 1.0 else None

    @staticmethod
    def for_row(
        options: SamplingOptions, prompt_ids: list[int], generated: list[int], stop_ids: Set[int] = frozenset()
    ) -> RowLogits | None:
        """None when the row's logits go to sampling untouched."""
        if options.logits_processors or options.presence_penalty or options.frequency_penalty or options.repetition_penalty != 1.0:
            return RowLogits(options, prompt_ids, generated, stop_ids)
        return None

    @property
    def pure(self) -> bool:
        """Whether the result depends on the tokens and logits alone (penalties, mlx-lm's logit-bias
        closure): then it can steer drafts too, which are never verified with it."""
        return all(isinstance(p, types.FunctionType) for p in self.processors)

    def ends(self, token: int, emitted: int) -> bool:
        """Whether the row finishes with ``token``, the ``emitted``-th of this step: a verify walk stops
        there, as plain decoding would (a stop string is found later, by the scheduler)."""
        return token in self.stop_ids or len(self.generated) + emitted >= self.max_tokens

    def __call__(self, logits: mx.array, drafts: Sequence[int] = ()) -> mx.array:
        """Processed logits [V] for the position after ``generated + drafts``."""
        context = self.generated + list(drafts) if drafts else self.generated
        x = logits.astype(mx.float32)[None]
        x = self._penalize(x, context)
        if self.processors:
            ids = mx.array(context, dtype=mx.uint32)
            for processor in self.processors:
                x = processor(ids, x)
        return x.reshape(-1)

    def _penalize(self, x: mx.array, context: list[int]) -> mx.array:
        if self._prompt_set is not None:
            seen = mx.array(np.union1d(self._prompt_set, np.asarray(context, dtype=np.int64)))
            picked = x[:, seen]
            x[:, seen] = mx.where(picked < 0, picked * self.repetition, picked / self.repetition)
        if (self.presence or self.frequency) and context:
            ids, counts = np.unique(np.asarray(context, dtype=np.int64), return_counts=True)
            x[:, mx.array(ids)] -= mx.array(self.frequency * counts + self.presence, dtype=mx.float32)
        return x


def steer_drafts(logits: mx.array, samplers: list[Any], drafting: list[bool], drafts: list[mx.array]) -> mx.array:
    """The MTP head's logits [B, V] for the next draft, with each drafting row's pure processing
    applied over its tokens and the drafts before (a better guess; every draft is verified anyway)."""
    rows = [i for i, (s, d) in enumerate(zip(samplers, drafting)) if d and s.logits is not None and s.logits.pure]
    if not rows:
        return logits
    before = cast("list[list[int]]", mx.stack(drafts, axis=1).tolist()) if drafts else [[] for _ in samplers]
    steered = [samplers[i].logits(logits[i], before[i]) if i in rows else logits[i] for i in range(len(samplers))]
    return mx.stack(steered).astype(logits.dtype)


def fork_options(options: SamplingOptions) -> SamplingOptions:
    """The same options with processors of its own, for another row of one request (n > 1).

    Call before either row decodes. Plain functions (mlx-lm's logit-bias closure) hold no state
    and are shared; a processor object is copied with its own mutable state (lists, dicts, deques,
    and the host's own helper objects, vllm-mlx 0.6.0 ``vllm_mlx.constrained``), sharing what is
    read-only or keyed by the whole token sequence (tokenizer, schema parser, token enforcer).
    """
    return replace(options, logits_processors=[_fork(p) for p in options.logits_processors])


def _fork(obj: Any) -> Any:
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, enum.Enum)):
        return obj
    clone = copy.copy(obj)
    for name in _state_names(obj):
        try:
            value = getattr(obj, name)
        except AttributeError:
            continue
        if isinstance(value, (list, dict, set, deque)):
            object.__setattr__(clone, name, copy.deepcopy(value))
        elif type(value).__module__.startswith("vllm_mlx."):
            object.__setattr__(clone, name, _fork(value))
    return clone


def _state_names(obj: Any) -> list[str]:
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return names
