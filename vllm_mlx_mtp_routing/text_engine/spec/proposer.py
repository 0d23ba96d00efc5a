"""The MTP proposer: the head's pairs over a prompt while it prefills, each row's pending pairs, k drafts a step.

The head's pair at position t is (hidden_t, token_t+1): the backbone's hidden state there (what the runner's
forward returns) with the token that follows. A chunk's last hidden state waits for the next chunk's first token
(or, at join, the prompt's last token); during decoding the pairs a verify accepted wait in the row's
``MTPRowState`` until the head next runs. When no row drafts the head does not run: each row keeps at most
``window`` pending pairs and the head skips the positions of older ones (``RaggedKVCache.skip_rows``), which costs
some acceptance and nothing in correctness, since every draft is verified. The head always runs over k + 1 pairs
per row, resuming in several such chunks: one shape per batch size, nothing is retraced or re-planned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ...model.mtp import MTPHead, lm_head
from ..batch_cache import RaggedKVCache
from ..logits_processing import steer_drafts
from ..sampling import RowSampler
from ..state import PrefillState
from .head_cache import PositionedKVCache
from .mtp_rows import MTPRowState

DEFAULT_PROMPT_PAIRS = 256


@dataclass
class Proposal:
    """A step's drafts: [B, k] tokens (lazy), per sampled drafting row the distributions q [k, V] they came from."""

    drafts: mx.array
    qs: dict[int, mx.array] = field(default_factory=dict)
    caught_up: bool = False  # the head resumed after plain steps (the step is not a steady one)


class MTPProposer:
    """Drafts with an MTP head bound to the served model (``build_text_model`` binds it)."""

    def __init__(
        self,
        head: MTPHead,
        k: int,
        *,
        hidden_state_mode: str | None = None,
        resume_window: int = 8,
        prompt_pairs: int | None = DEFAULT_PROMPT_PAIRS,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if prompt_pairs is not None and prompt_pairs < 1:
            raise ValueError(f"prompt_pairs must be >= 1 or None, got {prompt_pairs}")
        self.head = head
        self.k = k
        self.hidden_state_mode = hidden_state_mode or head.hidden_state_mode
        # Resuming after plain steps the head takes the last ``window`` pairs per row, so a plain step never runs
        # the head and a resume costs at most window / (k + 1) head forwards.
        self.resume_window = resume_window
        self.window = max(resume_window, k + 1)
        # The head takes the prompt's last ``prompt_pairs`` positions (None: all): each one costs the prefill the
        # backbone's last layer there, which a prefill without MTP never computes.
        self.prompt_pairs = prompt_pairs

    @property
    def head_layers(self) -> int:
        return len(self.head.layers)

    def plain(self) -> MTPProposer:
        """The head's own proposer with these settings (a subclass that steers the drafts returns to the head's)."""
        return MTPProposer(self.head, self.k, hidden_state_mode=self.hidden_state_mode,
                           resume_window=self.resume_window, prompt_pairs=self.prompt_pairs)

    # -- the prompt ----------------------------------------------------------------------------

    def wants_prefill_hidden(self, state: PrefillState, end: int) -> bool:
        """Does the head take pairs from the prefill chunk ending at ``end``? (False: a plain forward serves.)"""
        if state.head is not None:
            return True
        window_starts = None if self.prompt_pairs is None or state.prefill_to is None else state.prefill_to - self.prompt_pairs
        return window_starts is None or end > window_starts

    def skip_prefill_chunk(self, state: PrefillState) -> None:
        """A chunk before the head's window: no pair waits for its successor."""
        state.head_hidden = None

    def prefill(self, hidden: mx.array, tokens: mx.array, state: PrefillState, start: int) -> list[mx.array]:
        """Feed the head the pairs of a prefill chunk (``tokens`` [1, n] from prompt position ``start``, ``hidden``
        the backbone's [1, n, H] there); the arrays to evaluate with the chunk."""
        if state.head is None:
            # The head starts here: at 0, or past a restored prefix or the positions before its window, which it
            # skips (drafts are verified, so only acceptance can suffer).
            state.head = self.head.make_cache() if not start else [PositionedKVCache(start) for _ in self.head.layers]
            state.head_hidden = None
        cache, prev = state.head, state.head_hidden
        if prev is None:
            # The first chunk has one pair fewer than tokens: it runs with a dummy pair at its end (causal: no real
            # pair sees it), trimmed after, so the head's attention has the backbone's shape.
            self.head.forward(hidden, mx.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1), cache)
            for c in cache:
                c.trim(1)
        else:
            self.head.forward(mx.concatenate([prev, hidden[:, :-1]], axis=1), tokens, cache)
        state.head_hidden = hidden[:, -1:]
        return [*(c.state for c in cache), state.head_hidden]

    def join(self, state: PrefillState, prompt_ids: list[int]) -> MTPRowState:
        """A prefilled row's MTP state as it joins the batch."""
        r = MTPRowState(history=list(prompt_ids), prompt_len=len(prompt_ids))
        if state.head_hidden is not None:
            r.add_pending(state.head_hidden, 0, prompt_ids[-1:])
        # Head positions the restored state did not cover (no head cache, no pending pair) are skipped, so every
        # later pair still sits at its own position.
        held = 0 if not state.head or state.head[0].keys is None else state.head[0].offset
        r.skipped = max(0, state.next_position - held - len(r.pending_t))
        return r

    # -- decoding ------------------------------------------------------------------------------

    def propose(
        self, k: int, rows: Sequence[MTPRowState], cache: list[RaggedKVCache], drafting: list[bool],
        samplers: Sequence[RowSampler],
    ) -> Proposal:
        """k drafts per row (argmax for greedy rows, sampled from the row's processed q for the others)."""
        out, pre, counts, caught_up = self._sync(rows, cache)
        last = mx.array([max(n - 1, 0) for n in counts])[:, None, None]
        h_out = mx.take_along_axis(out, last, axis=1)
        h_pre = mx.take_along_axis(pre, last, axis=1)
        sampled = [i for i, (d, s) in enumerate(zip(drafting, samplers)) if d and not s.greedy]
        qs: dict[int, list[mx.array]] = {i: [] for i in sampled}
        drafts: list[mx.array] = []
        for j in range(k):
            logits = steer_drafts(lm_head(self.head.backbone, h_out)[:, 0], list(samplers), drafting, drafts)
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
                h_out, h_pre = self.head.forward(h, tok[:, None], cache)
        if k > 1:  # the recursive entries were built from drafts, not verified hidden states
            for c in cache:
                c.trim_rows([k - 1] * len(drafting))
        return Proposal(mx.stack(drafts, axis=1).astype(mx.uint32), {i: mx.stack(q) for i, q in qs.items()}, caught_up)

    def after_verify(self, rows: Sequence[MTPRowState], hidden: mx.array, tokens: list[list[int]]) -> None:
        """The verify's accepted positions become each row's pending pairs."""
        for i, (r, toks) in enumerate(zip(rows, tokens)):
            r.add_pending(hidden, i, toks)
            r.keep_last(self.window)
            r.history.extend(toks)

    def _sync(self, rows: Sequence[MTPRowState], cache: list[RaggedKVCache]) -> tuple[mx.array, mx.array, list[int], bool]:
        """Feed every row's pending pairs to the head -> (normed, pre-norm) outputs, counts, whether it resumed."""
        counts = [len(r.pending_t) for r in rows]
        C = self.k + 1
        # Resuming after plain steps, the head runs over the window in chunks of k + 1, the steady shape.
        L = C * -(-max(max(counts), 1) // C)
        skipped = [r.skipped for r in rows]
        caught_up = L > C or any(skipped)
        for c in cache:
            c.skip_rows(skipped)
        h = self._pending_hidden(rows, L)
        t = mx.array([r.pending_t + [0] * (L - len(r.pending_t)) for r in rows], dtype=mx.uint32)
        outs = [self.head.forward(h[:, i : i + C], t[:, i : i + C], cache) for i in range(0, L, C)]
        out = mx.concatenate([o for o, _ in outs], axis=1) if len(outs) > 1 else outs[0][0]
        pre = mx.concatenate([p for _, p in outs], axis=1) if len(outs) > 1 else outs[0][1]
        # Rows are right-padded: no real pair attends to padding, and the padding goes once all chunks are in.
        for c in cache:
            c.trim_rows([L - n for n in counts])
        for r in rows:
            r.pending_h, r.pending_t, r.skipped = [], [], 0
        return out, pre, counts, caught_up

    def _pending_hidden(self, rows: Sequence[MTPRowState], L: int) -> mx.array:
        """[B, L, H]: each row's pending hidden states, right-padded with zeros to L."""
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
