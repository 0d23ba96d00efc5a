"""Batched MTP speculative decoding with per-row acceptance (a ``DecodeStrategy``).

One step for a batch of B rows, each row i holding its prompt and generated tokens up to the
token x_i it feeds next:

1. draft: the MTP head takes, per row, the (backbone hidden, token) pairs verified since its last
   draft (one forward for the batch, rows padded to the longest and trimmed back: the head's
   attention cache is a ``RaggedKVCache``), and proposes k tokens per row, recursively as in
   ``MTPHead.draft`` (argmax for greedy rows, sampled from the row's processed distribution q for
   the others);
2. verify: ONE backbone forward of [x_i, d_i1..d_ik] for the whole batch. The gated-delta layers
   keep their recurrent state after every position (the per-token recurrence runs as a loop
   anyway on CPU/CUDA; nothing is recomputed) and the conv window input;
3. accept, per row: greedy rows take the longest prefix of drafts equal to the backbone's argmax;
   sampled rows run speculative sampling (accept d with prob min(1, p(d)/q(d)), else resample from
   norm(max(p - q, 0)); the bonus token from p after the last accepted draft). Row i emits
   1 + a_i tokens;
4. roll back, per row: attention KV by ``RaggedKVCache.trim_rows``, gated-delta recurrent and conv
   state by selecting position a_i's captured state per row.

Rows that do not draft this step (no pairs yet, at most one token left)
feed [x_i, x_i, ...]: the padding is computed and discarded and rolled back like a rejected
draft, so rows with and without drafts share one forward. When no row drafts, the step is a plain
[B, 1] decode and the head does not run: its hidden states are kept as pending pairs, at most
``resume_window`` per row; when drafting resumes the head takes those and skips the positions of
older ones (``RaggedKVCache.skip_rows``: the head attends over a gap, which costs some acceptance
and nothing in correctness, since every draft is verified). The head always runs over k + 1
pairs per row, resuming in several such chunks: one shape per batch size, nothing is retraced or
re-planned (on CUDA a new attention shape is a new cuDNN plan).

Modules: the verify forward with capture and the rollback are ``backbone.py`` (plain functions
over arrays), acceptance is ``acceptance.py``, the draft policy (plan/observe) is
``draft_policy.py``, a row's MTP state is ``mtp_rows.py``; this module drafts with the head and
runs the step.

Seeds: every random number comes from the row's own ``RowSampler`` key stream, a fixed number of
keys per step for a given draft count, so a seeded request reproduces given the same drafting
decisions; the draft policy makes a seeded sampled row's decisions depend on the row alone. A row
that never drafts consumes keys exactly as ``SingleTokenDecode`` does.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..model.backbone import _recurrence_with_states, backbone_forward  # noqa: F401 (the capture, re-exported for its test)
from ..model.mtp import MTPHead, lm_head
from .acceptance import accept_rows, speculative_row  # noqa: F401 (re-exported)
from .batch_cache import BatchCache, RaggedKVCache
from .decode import DecodeResult
from .draft_policy import DraftPolicy
from .head_cache import PositionedKVCache
from .logits_processing import steer_drafts
from .logprobs import row_logprobs
from .mtp_rows import MTPRowState
from .rows import DecodeBatch, PrefillState
from .sampling import RowSampler

# (histories, drafts) -> drafts. histories[i]: row i's prompt + generated tokens (its last token
# is the one it feeds now); drafts[i]: the head's k drafts, or None for a row not drafting. A hook
# replaces the drafter (tests and benchmarks force acceptance with it); a row whose drafts it
# changes counts them as deterministic (q = one-hot), which keeps sampling exact for any proposal.
DraftHook = Callable[[list[list[int]], list[list[int] | None]], list[list[int] | None]]

DEFAULT_PROMPT_PAIRS = 256


class MTPDecode:
    """Batched MTP speculative decoding for the text engine (see the module docstring).

    ``TextEngine(model, tokenizer, decode=MTPDecode(bundle.mtp, k=1))``; the head must be bound
    to the same TextModel (``build_text_model`` does that). ``policy`` replaces the
    ``DraftPolicy(k, adaptive=..., max_batch_size=...)`` built from the other arguments.
    """

    def __init__(
        self,
        head: MTPHead,
        k: int = 1,
        *,
        hidden_state_mode: str | None = None,
        adaptive: bool = True,
        max_batch_size: int | None = None,
        per_row_acceptance: bool = True,
        resume_window: int = 8,
        prompt_pairs: int | None = DEFAULT_PROMPT_PAIRS,
        draft_hook: DraftHook | None = None,
        policy: DraftPolicy | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.head = head
        self.k = k
        self.hidden_state_mode = hidden_state_mode or head.hidden_state_mode
        self.per_row_acceptance = per_row_acceptance  # False: batch-wide all-or-nothing, for comparison
        self.policy = policy or DraftPolicy(k, adaptive=adaptive, max_batch_size=max_batch_size)
        # Resuming after plain steps the head takes the last ``window`` pairs per row (older ones
        # are skipped), so a plain step never runs the head and a resume costs at most
        # window / (k + 1) head forwards.
        self.window = max(resume_window, k + 1)
        # The head over the prompt in the prefill: from the chunk that holds the prompt's last
        # ``prompt_pairs`` positions on (None: every position). Each position the head takes costs
        # the prefill the backbone's last layer there (a prefill without MTP never computes its
        # output) and the head's projections: +21% on a 3K-token prefill of the tiny trained
        # model on CPU when it takes them all.
        if prompt_pairs is not None and prompt_pairs < 1:
            raise ValueError(f"prompt_pairs must be >= 1 or None, got {prompt_pairs}")
        self.prompt_pairs = prompt_pairs
        self.draft_hook = draft_hook
        self._fresh_state()

    def _fresh_state(self) -> None:
        """What stepping a batch accumulates: its binding, step timing and counts (``twin`` starts from none)."""
        self._batch: DecodeBatch | None = None
        self._version = -1
        # End of the last step, None after a join or leave. A step is timed from there (when the
        # batch did not change in between): the whole cycle, with the scheduler's and the
        # server's own per-step work (outputs, streaming), which drafting also divides by the
        # tokens a step yields.
        self._last_end: float | None = None
        self._caught_up = False  # this step's head sync resumed after plain steps (not timed)
        self.drafted = 0
        self.accepted = 0
        self.steps_with_mtp = 0
        self.steps_without_mtp = 0
        self.accepted_histogram = [0] * (self.k + 1)  # per drafting row-step: how many drafts it kept

    def twin(self, policy: DraftPolicy) -> MTPDecode:
        """The same head, draft count and settings, with none of this strategy's batch, timings or counts, drafting
        as ``policy`` decides and without the draft hook: the start-up warm-up steps it (warmup.py), so nothing it
        does reaches this one's policy or stats."""
        twin = copy.copy(self)
        twin.policy = policy
        twin.draft_hook = None
        twin._fresh_state()
        return twin

    @property
    def adaptive(self) -> bool:
        return self.policy.adaptive

    # -- DecodeStrategy: bind / prefill / join -------------------------------------------------

    @property
    def head_layers(self) -> int:
        return len(self.head.layers)

    def bind(self, batch: DecodeBatch) -> None:
        self._batch = batch

    @property
    def _rows(self) -> list[MTPRowState]:
        """The rows' MTP state, in batch row order (each owned by its ``Row``)."""
        return [r.decode for r in self._batch.rows]

    @property
    def _cache(self) -> list[RaggedKVCache]:
        """The head's batch caches (owned by the ``DecodeBatch``, rows joining and leaving with
        the backbone's)."""
        return self._batch.head

    def prefill(self, model: nn.Module, tokens: mx.array, state: PrefillState) -> None:
        start, end = state.prefilled, state.prefilled + tokens.shape[1]
        if state.head is None:
            if self.prompt_pairs is not None and state.prefill_to is not None and end <= state.prefill_to - self.prompt_pairs:
                # Before the head's pairs: mlx-lm's own forward, which costs what a prefill without
                # MTP costs (nothing reads the last layer's output, so it is never computed).
                model(tokens, cache=state.backbone)
                state.head_hidden = None
                mx.eval([c.state for c in state.backbone])
                return
            # The head starts here: at 0, or past a restored prefix or the positions before its
            # window, which it skips (drafts are verified, so only acceptance can suffer).
            state.head = self.head.make_cache() if not start else [PositionedKVCache(start) for _ in self.head.layers]
            state.head_hidden = None
        _, hidden, _ = backbone_forward(
            model, tokens, state.backbone, hidden_state_mode=self.hidden_state_mode, logits=False
        )
        mcache = state.head
        prev = state.head_hidden
        # The head's pair at position t is (hidden_t, token_{t+1}): a chunk's last hidden state
        # waits for the next chunk's first token (or, at join, the prompt's last token).
        if prev is None:
            # The first chunk has one pair fewer than tokens. It runs with a dummy pair at its end
            # (causal: no real pair sees it) that is trimmed after: the head's attention then has
            # the backbone's shape, and on CUDA a chunk length's cuDNN plan is built once for
            # both instead of once more per prompt length for the head.
            ph, pt = hidden, mx.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
            self.head.forward(ph, pt, mcache)
            for c in mcache:
                c.trim(1)
        else:
            self.head.forward(mx.concatenate([prev, hidden[:, :-1]], axis=1), tokens, mcache)
        state.head_hidden = hidden[:, -1:]
        mx.eval([c.state for c in state.backbone], [c.state for c in mcache], state.head_hidden)

    def join(self, state: PrefillState, prompt_ids: list[int]) -> MTPRowState:
        r = MTPRowState(history=list(prompt_ids), prompt_len=len(prompt_ids))
        if state.head_hidden is not None:
            r.add_pending(state.head_hidden, 0, prompt_ids[-1:])
        # Head positions the restored state did not cover (no head cache, no pending pair) are
        # skipped, so every later pair still sits at its own position.
        held = 0 if not state.head or state.head[0].keys is None else state.head[0].offset
        r.skipped = max(0, state.next_position - held - len(r.pending_t))
        return r

    # -- the step ---------------------------------------------------------------------------

    def step(
        self, model: nn.Module, cache: BatchCache, inputs: list[int], samplers: list[RowSampler]
    ) -> DecodeResult:
        rows, B = self._rows, len(inputs)
        if len(rows) != B:
            raise RuntimeError(f"MTPDecode holds {len(rows)} rows, the batch has {B}")
        if self._batch.version != self._version:  # rows joined or left: the cycle is not timed
            self._version, self._last_end = self._batch.version, None
        k, drafting = self.policy.plan(self._plan_k(B), rows, samplers)
        x = mx.array(inputs, dtype=mx.uint32)[:, None]
        drafts, qs = None, {}
        if k:
            drafts, qs = self._draft(k, drafting, samplers)
            if self.draft_hook is not None:
                drafts = self._apply_hook(drafts, drafting, samplers, qs)
            feed = mx.concatenate([x, mx.where(mx.array(drafting)[:, None], drafts, x)], axis=1)
        else:
            feed = x
        logits, hidden, captured = backbone_forward(
            model, feed, cache.layers, hidden_state_mode=self.hidden_state_mode, capture=k > 0
        )
        tokens, accepted = self._accept(logits, drafts, qs, drafting, samplers, k)
        keep = [len(t) for t in tokens]
        cache.rollback(captured, keep, k + 1)
        for i, (r, toks) in enumerate(zip(rows, tokens)):
            r.add_pending(hidden, i, toks)
            r.keep_last(self.window)
            r.history.extend(toks)
        # Started, not awaited: the rollback runs while the scheduler does its bookkeeping.
        mx.async_eval(cache.state(), [c.state for c in self._cache])
        end = time.perf_counter()
        cycle = None if self._last_end is None else end - self._last_end
        self._last_end = end
        self._record(cache, B, k, drafting, accepted, cycle)
        return DecodeResult(tokens, [k if d else 0 for d in drafting], accepted, row_logprobs(logits, tokens, samplers))

    def _accept(
        self, logits: mx.array, drafts: mx.array | None, qs: dict[int, mx.array], drafting: list[bool],
        samplers: list[RowSampler], k: int,
    ) -> tuple[list[list[int]], list[int]]:
        """The verify's tokens and accepted counts per row (``testing.forced_acceptance`` overrides
        it to make acceptance a controlled input)."""
        return accept_rows(logits, drafts, qs, drafting, samplers, k, self.per_row_acceptance)

    # -- drafting ---------------------------------------------------------------------------

    def _pending_hidden(self, L: int) -> mx.array:
        """[B, L, H]: each row's pending hidden states, right-padded with zeros to L."""
        rows = self._rows
        src = rows[0].pending_h[0][0] if rows[0].pending_h else None
        # Steady state: every row's pairs come from the last verify, in the same row order.
        if (
            src is not None
            and src.shape[0] == len(rows)
            and src.shape[1] >= L
            and all(len(r.pending_h) == 1 and r.pending_h[0][0] is src and r.pending_h[0][1:3] == (i, 0)
                    for i, r in enumerate(rows))
        ):
            return src[:, :L]
        dtype = next((r.pending_h[0][0].dtype for r in rows if r.pending_h), mx.float32)
        H = self.head.backbone.args.hidden_size
        out = []
        for r in rows:
            parts = [h[i, a:b] for h, i, a, b in r.pending_h]
            n = len(r.pending_t)
            if n < L:
                parts.append(mx.zeros((L - n, H), dtype=dtype))
            out.append(mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0])
        return mx.stack(out)

    def _sync_head(self) -> tuple[mx.array, mx.array, list[int]]:
        """Feed every row's pending pairs to the head; (normed, pre-norm) outputs and counts."""
        rows = self._rows
        counts = [len(r.pending_t) for r in rows]
        C = self.k + 1
        # Resuming after plain steps, the head runs over the window in chunks of k + 1, the
        # steady shape: one shape per batch size, where a [B, window] forward is a new attention
        # plan on CUDA (~55 ms on an H200, once per batch size; benchmarks/gpu_step_trace.py).
        L = C * -(-max(max(counts), 1) // C)
        skipped = [r.skipped for r in rows]
        self._caught_up = L > C or any(skipped)
        for c in self._cache:
            c.skip_rows(skipped)
        h = self._pending_hidden(L)
        t = mx.array([r.pending_t + [0] * (L - len(r.pending_t)) for r in rows], dtype=mx.uint32)
        outs = [self.head.forward(h[:, i : i + C], t[:, i : i + C], self._cache) for i in range(0, L, C)]
        out = mx.concatenate([o for o, _ in outs], axis=1) if len(outs) > 1 else outs[0][0]
        pre = mx.concatenate([p for _, p in outs], axis=1) if len(outs) > 1 else outs[0][1]
        # Rows are right-padded: every row's padding follows its real pairs, so no real pair
        # attends to padding, and the padding goes once all chunks are in.
        for c in self._cache:
            c.trim_rows([L - n for n in counts])
        for r in rows:
            r.pending_h, r.pending_t, r.skipped = [], [], 0
        return out, pre, counts

    def _draft(
        self, k: int, drafting: list[bool], samplers: list[RowSampler]
    ) -> tuple[mx.array, dict[int, mx.array]]:
        """Drafts [B, k] (lazy) and, per sampled drafting row, the distributions q [k, V]."""
        out, pre, counts = self._sync_head()
        last = mx.array([max(n - 1, 0) for n in counts])[:, None, None]
        h_out = mx.take_along_axis(out, last, axis=1)
        h_pre = mx.take_along_axis(pre, last, axis=1)
        sampled = [i for i, (d, s) in enumerate(zip(drafting, samplers)) if d and not s.greedy]
        qs: dict[int, list[mx.array]] = {i: [] for i in sampled}
        drafts = []
        for j in range(k):
            logits = steer_drafts(lm_head(self.head.backbone, h_out)[:, 0], samplers, drafting, drafts)
            tok = mx.argmax(logits, axis=-1)
            if sampled:
                picks = []
                for i in range(len(drafting)):
                    if i in qs:
                        xq = samplers[i].process(logits[i])
                        qs[i].append(mx.softmax(xq, axis=-1))
                        picks.append(mx.random.categorical(xq, key=samplers[i].next_key()).astype(tok.dtype))
                    else:
                        picks.append(tok[i])
                tok = mx.stack(picks)
            drafts.append(tok)
            if j + 1 < k:
                h = h_pre if self.hidden_state_mode == "pre_norm" else h_out
                h_out, h_pre = self.head.forward(h, tok[:, None], self._cache)
        if k > 1:  # the recursive entries were built from drafts, not verified hidden states
            for c in self._cache:
                c.trim_rows([k - 1] * len(drafting))
        return mx.stack(drafts, axis=1).astype(mx.uint32), {i: mx.stack(q) for i, q in qs.items()}

    def _apply_hook(
        self, drafts: mx.array, drafting: list[bool], samplers: list[RowSampler], qs: dict[int, mx.array]
    ) -> mx.array:
        proposed = drafts.tolist()
        given = [p if d else None for p, d in zip(proposed, drafting)]
        new = self.draft_hook([list(r.history) for r in self._rows], given)
        V = self.head.backbone.args.vocab_size
        for i, d in enumerate(drafting):
            if d and list(new[i]) != proposed[i]:
                proposed[i] = list(new[i])
                if not samplers[i].greedy:  # the hook's own tokens: a point mass at each
                    qs[i] = (mx.arange(V)[None, :] == mx.array(proposed[i])[:, None]).astype(mx.float32)
        return mx.array(proposed, dtype=mx.uint32)

    # -- policy and stats -----------------------------------------------------------------

    def _plan_k(self, B: int) -> int:
        return self.policy.draft_count(B)

    def _shape(self, cache: BatchCache, B: int, k: int) -> tuple[int, ...]:
        """What a step's kernels are specialized on: the batch, the draft count and the spans of
        keys attention reads (on CUDA a new span is a new attention plan)."""
        kv = next((c for c in cache.layers if isinstance(c, RaggedKVCache)), None)
        caps = [c.capacity if c is not None else 0 for c in (kv, self._cache[0])]
        return (B, k, *caps)

    def _record(self, cache: BatchCache, B: int, k: int, drafting: list[bool], accepted: list[int],
                seconds: float | None) -> None:
        if k:
            self.steps_with_mtp += 1
        else:
            self.steps_without_mtp += 1
        for d, a in zip(drafting, accepted):
            if d:
                self.drafted += k
                self.accepted += a
                self.accepted_histogram[a] += 1
        caught_up, self._caught_up = self._caught_up, False
        self.policy.observe(self._rows, k, drafting, accepted, seconds=seconds, shape=self._shape(cache, B, k),
                            timed=not caught_up)

    def stats(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "steps_with_mtp": self.steps_with_mtp,
            "steps_without_mtp": self.steps_without_mtp,
            "accepted_histogram": list(self.accepted_histogram),
            "per_row_acceptance": self.per_row_acceptance,
            **self.policy.stats(),
        }
