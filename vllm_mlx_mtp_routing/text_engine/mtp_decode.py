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

Rows that do not draft this step (no pairs yet, low recent acceptance, at most one token left)
feed [x_i, x_i, ...]: the padding is computed and discarded and rolled back like a rejected
draft, so rows with and without drafts share one forward. When no row drafts, the step is a plain
[B, 1] decode and the head does not run: its hidden states are kept as pending pairs, at most
``resume_window`` per row; when drafting resumes the head takes those and skips the positions of
older ones (``RaggedKVCache.skip_rows``: the head attends over a gap, which costs some acceptance
and nothing in correctness, since every draft is verified). The head always runs over k + 1
pairs per row, resuming in several such chunks: one shape per batch size, nothing is retraced or
re-planned (on CUDA a new attention shape is a new cuDNN plan).

Adaptivity (``adaptive=True``): a step drafts only while some row's recent acceptance (an EMA)
is at least ``min_row_acceptance`` (rows probe again every ``probe_every`` steps); then every row
that can draft does, since a row left out is fed padding that costs the verify what its draft
would (pausing one row of a drafting batch saves nothing and loses its accepts). Per step, the
number of drafts (0..k) is chosen by measured throughput per batch-size bucket
(``DraftSchedule``: hysteresis near a tie, explorations that back off). Steps that compile or
plan a new shape (batch, draft count, KV buffer capacity) or resume the head are not timed; a
timed step counts from the end of the one before, so the per-step work around it counts too.
``max_batch_size`` turns drafting off above a batch size outright.

Seeds: every random number comes from the row's own ``RowSampler`` key stream, a fixed number of
keys per step for a given draft count, so a seeded request reproduces given the same drafting
decisions. A row that never drafts consumes keys exactly as ``SingleTokenDecode`` does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
# mlx-lm 0.31.3 internals of gated_delta_update (the gates, its compiled step and its Metal kernel):
# the verify keeps the state after every position, which the public function does not return.
from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, gated_delta_kernel

from ..mtp import MTPHead, lm_head
from .batch_cache import BatchCache, RaggedKVCache
from .decode import DecodeResult
from .rows import DecodeBatch, PrefillState
from .draft_schedule import DraftSchedule
from .sampling import RowSampler

logger = logging.getLogger(__name__)

# (histories, drafts) -> drafts. histories[i]: row i's prompt + generated tokens (its last token
# is the one it feeds now); drafts[i]: the head's k drafts, or None for a row not drafting. A hook
# replaces the drafter (tests and benchmarks force acceptance with it); a row whose drafts it
# changes counts them as deterministic (q = one-hot), which keeps sampling exact for any proposal.
DraftHook = Callable[[list[list[int]], list[list[int] | None]], list[list[int] | None]]


# --------------------------------------------------------------------------------------------
# Backbone forward with per-position gated-delta states
# --------------------------------------------------------------------------------------------


def _recurrence_with_states(
    lin: nn.Module, q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, state: mx.array | None
) -> tuple[mx.array, list[mx.array]]:
    """The gated-delta recurrence over S positions -> (y [B, S, Hv, Dv], the state after each).

    mlx-lm 0.31.3's ``gated_delta_update`` computes the gates and the GQA repeat once per call and
    then (CPU, CUDA) loops its compiled single step over the positions, or (Metal) runs one fused
    kernel over all of them. The capture does the same loop with the per-position states kept:
    gates and repeat once, then one step per position (the fused kernel over one position on
    Metal). Calling ``gated_delta_update`` per position instead repeated the gates and the repeat
    S times, ~36 more launches per verify step, which a launch-bound GPU pays in full.
    """
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    beta = mx.sigmoid(b)
    g = compute_g(lin.A_log, a, lin.dt_bias)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    fused = not lin.training and mx.default_device() == mx.gpu and mx.metal.is_available()
    if not fused and Hv // Hk > 1:  # the Metal kernel maps key heads to value heads itself
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    ys, states = [], []
    for t in range(S):
        s = slice(t, t + 1)
        if fused:
            y, state = gated_delta_kernel(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], state)
        else:
            y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
            y = y[:, None]
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), states


def _gated_delta_capture(lin: nn.Module, x: mx.array, cache: Any) -> tuple[mx.array, mx.array, list[mx.array]]:
    """mlx-lm 0.31.3 ``GatedDeltaNet.__call__`` (unmasked, unsharded), also returning the conv
    window input and the recurrent state after every position (the recurrence runs position by
    position anyway, so keeping the states costs no extra compute)."""
    B, S, _ = x.shape
    qkv = lin.in_proj_qkv(x)
    z = lin.in_proj_z(x).reshape(B, S, lin.num_v_heads, lin.head_v_dim)
    b = lin.in_proj_b(x)
    a = lin.in_proj_a(x)
    n_keep = lin.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, lin.conv_dim), x.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(lin.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [lin.key_dim, 2 * lin.key_dim], -1),
            [lin.num_k_heads, lin.num_k_heads, lin.num_v_heads],
            [lin.head_k_dim, lin.head_k_dim, lin.head_v_dim],
        )
    ]
    inv_scale = k.shape[-1] ** -0.5
    q = (inv_scale**2) * mx.fast.rms_norm(q, None, 1e-6)
    k = inv_scale * mx.fast.rms_norm(k, None, 1e-6)
    y, states = _recurrence_with_states(lin, q, k, v, a, b, cache[1])
    cache[1] = states[-1]
    out = lin.norm(y, z)
    return lin.out_proj(out.reshape(B, S, -1)), conv_input, states


@dataclass
class _Captured:
    cache: Any  # the layer's ArraysCache
    conv_input: mx.array  # [B, n_keep + S, C]
    states: list[mx.array]  # recurrent state after each of the S positions


def backbone_forward(
    model: nn.Module,
    inputs: mx.array,
    cache: list[Any],
    *,
    hidden_state_mode: str = "post_norm",
    logits: bool = True,
    capture: bool = False,
) -> tuple[mx.array | None, mx.array, list[_Captured]]:
    """The decoder stack of mlx-lm 0.31.3's qwen3_5 model (its fa_idx/ssm_idx/is_linear
    internals) -> (logits or None, the hidden state the MTP head reads, captured gated-delta states)."""
    inner = model.model
    h = inner.embed_tokens(inputs)
    fa_mask = create_attention_mask(h, cache[inner.fa_idx])
    ssm_mask = create_ssm_mask(h, cache[inner.ssm_idx])
    if capture and ssm_mask is not None:
        raise ValueError("capturing gated-delta states needs unmasked (unpadded) rows")
    captured: list[_Captured] = []
    for layer, c in zip(inner.layers, cache):
        if not layer.is_linear:
            h = layer(h, mask=fa_mask, cache=c)
        elif not capture:
            h = layer(h, mask=ssm_mask, cache=c)
        else:
            r, conv_input, states = _gated_delta_capture(layer.linear_attn, layer.input_layernorm(h), c)
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            captured.append(_Captured(c, conv_input, states))
    post = inner.norm(h)
    out = lm_head(model, post) if logits else None
    return out, (h if hidden_state_mode == "pre_norm" else post), captured


def rollback_rows(cache: BatchCache, captured: list[_Captured], keep: list[int], fed: int) -> None:
    """Row i keeps the first keep[i] of the ``fed`` tokens of the last captured forward."""
    drop = [fed - n for n in keep]
    if not any(drop):
        return
    for c in cache.layers:
        if isinstance(c, RaggedKVCache):
            c.trim_rows(drop)
    if not captured:
        return
    B = len(keep)
    # Built once for all layers (each op is a launch, and a launch-bound GPU pays per launch).
    last = mx.array([n - 1 for n in keep])
    first = (last == 0)[:, None, None, None]
    rows = mx.arange(B)
    n_keep = captured[0].conv_input.shape[1] - fed
    pos = (last + 1)[:, None, None] + mx.arange(n_keep)[None, :, None]
    for cap in captured:
        if fed == 2:  # the common k = 1 case: one select instead of a stack and a gather
            cap.cache[1] = mx.where(first, cap.states[0], cap.states[1])
        else:
            cap.cache[1] = mx.stack(cap.states)[last, rows]
        cap.cache[0] = mx.take_along_axis(cap.conv_input, pos, axis=1)


# --------------------------------------------------------------------------------------------
# Speculative sampling for one row
# --------------------------------------------------------------------------------------------


def speculative_row(
    p_logits: mx.array, q: mx.array, drafts: mx.array, accept_key: mx.array, sample_key: mx.array
) -> tuple[mx.array, mx.array]:
    """Lazy speculative sampling of one row with k drafts.

    p_logits [k+1, V]: the target's processed logits at [x, d_1..d_k]; q [k, V]: the draft
    distributions d_j was sampled from; drafts [k]. Returns (accept [k] bool, candidates [k+1]):
    draft j is accepted with prob min(1, p_j(d_j)/q_j(d_j)); candidates[j] is the replacement
    sampled from norm(max(p_j - q_j, 0)) for j < k, and the bonus token from p_k at j = k. The row
    keeps drafts up to the first rejection j and then candidates[j].
    """
    k = drafts.shape[0]
    p = mx.softmax(p_logits, axis=-1)
    idx = drafts[:, None].astype(mx.int32)
    pd = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]
    qd = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    accept = mx.random.uniform(shape=(k,), key=accept_key) * qd < pd
    resid = mx.maximum(p[:k] - q, 0.0)
    # p == q leaves no residual; a rejection then has probability 0, any p-sample is as good.
    resid = mx.where(resid.sum(axis=-1, keepdims=True) > 0, resid, p[:k])
    dists = mx.concatenate([resid, p[k:]], axis=0)
    cands = mx.random.categorical(mx.log(dists), key=sample_key)
    return accept, cands


# --------------------------------------------------------------------------------------------
# The strategy
# --------------------------------------------------------------------------------------------


@dataclass
class _Row:
    history: list[int]  # prompt + generated tokens (the last is the row's next input)
    prompt_len: int
    # Pairs verified since the head's last sync: hidden[row, start:stop] of a step's [B', T, H]
    # hidden state, with the tokens that follow them.
    pending_h: list[tuple[mx.array, int, int, int]] = field(default_factory=list)
    pending_t: list[int] = field(default_factory=list)
    skipped: int = 0  # older pairs dropped unsynced: the head skips their positions
    ema: float = 1.0  # recent acceptance rate (optimistic start)
    idle: int = 0  # steps since the row last drafted

    def add_pending(self, hidden: mx.array, i: int, tokens: list[int]) -> None:
        self.pending_h.append((hidden, i, 0, len(tokens)))
        self.pending_t.extend(tokens)

    def keep_last(self, window: int) -> None:
        """Keep at most ``window`` pending pairs, dropping the oldest."""
        drop = len(self.pending_t) - window
        if drop <= 0:
            return
        self.skipped += drop
        self.pending_t = self.pending_t[drop:]
        while drop:
            h, i, a, b = self.pending_h[0]
            n = min(drop, b - a)
            if n == b - a:
                self.pending_h.pop(0)
            else:
                self.pending_h[0] = (h, i, a + n, b)
            drop -= n


class MTPDecode:
    """Batched MTP speculative decoding for the text engine (see the module docstring).

    ``TextEngine(model, tokenizer, decode=MTPDecode(bundle.mtp, k=1))``; the head must be bound
    to the same TextModel (``build_text_model`` does that).
    """

    def __init__(
        self,
        head: MTPHead,
        k: int = 1,
        *,
        hidden_state_mode: str | None = None,
        adaptive: bool = True,
        per_row_acceptance: bool = True,
        max_batch_size: int | None = None,
        min_row_acceptance: float = 0.15,
        probe_every: int = 16,
        explore_every: int = 16,
        max_explore_every: int = 256,
        explore_steps: int = 5,
        margin: float = 1.03,
        reset_gain: float = 1.15,
        resume_window: int = 8,
        draft_hook: DraftHook | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.head = head
        self.k = k
        self.hidden_state_mode = hidden_state_mode or head.hidden_state_mode
        self.adaptive = adaptive
        self.per_row_acceptance = per_row_acceptance
        self.max_batch_size = max_batch_size
        self.min_row_acceptance = min_row_acceptance
        self.probe_every = probe_every
        self.schedule = DraftSchedule(
            k, explore_every=explore_every, max_explore_every=max_explore_every,
            explore_steps=explore_steps, margin=margin, reset_gain=reset_gain,
        )
        # Resuming after plain steps the head takes the last ``window`` pairs per row (older ones
        # are skipped), so a plain step never runs the head and a resume costs at most
        # window / (k + 1) head forwards.
        self.window = max(resume_window, k + 1)
        self.draft_hook = draft_hook
        self._batch: DecodeBatch | None = None
        self._version = -1
        self._last_shape: tuple[int, ...] = ()
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
        self.accepted_histogram = [0] * (k + 1)  # per drafting row-step: how many drafts it kept

    # -- DecodeStrategy: bind / prefill / join -------------------------------------------------

    @property
    def head_layers(self) -> int:
        return len(self.head.layers)

    def bind(self, batch: DecodeBatch) -> None:
        self._batch = batch

    @property
    def _rows(self) -> list[_Row]:
        """The rows' MTP state, in batch row order (each owned by its ``Row``)."""
        return [r.decode for r in self._batch.rows]

    @property
    def _cache(self) -> list[RaggedKVCache]:
        """The head's batch caches (owned by the ``DecodeBatch``, rows joining and leaving with
        the backbone's)."""
        return self._batch.head

    def prefill(self, model: nn.Module, tokens: mx.array, state: PrefillState) -> None:
        _, hidden, _ = backbone_forward(
            model, tokens, state.backbone, hidden_state_mode=self.hidden_state_mode, logits=False
        )
        if state.head is None and state.prefilled:
            # Restored without the head's pairs: the head starts at the row's join, skipping the
            # positions before its last pair (drafts are verified, so only acceptance suffers).
            state.head_hidden = hidden[:, -1:]
            mx.eval([c.state for c in state.backbone], state.head_hidden)
            return
        if state.head is None:
            state.head = self.head.make_cache()
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

    def join(self, state: PrefillState, prompt_ids: list[int]) -> _Row:
        r = _Row(history=list(prompt_ids), prompt_len=len(prompt_ids))
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
        k = self._plan_k(B)
        drafting = [k > 0 and self._can_draft(r, s) for r, s in zip(rows, samplers)]
        if not any(d and self._worth_drafting(r) for d, r in zip(drafting, rows)):
            k, drafting = 0, [False] * B
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
        rollback_rows(cache, captured, keep, k + 1)
        for i, (r, toks) in enumerate(zip(rows, tokens)):
            r.add_pending(hidden, i, toks)
            r.keep_last(self.window)
            r.history.extend(toks)
        # Started, not awaited: the rollback runs while the scheduler does its bookkeeping.
        mx.async_eval(cache.state(), [c.state for c in self._cache])
        end = time.perf_counter()
        cycle = None if self._last_end is None else end - self._last_end
        self._last_end = end
        self._record(cache, B, k, drafting, accepted, sum(keep), cycle)
        return DecodeResult(tokens, [k if d else 0 for d in drafting], accepted)

    # -- drafting ---------------------------------------------------------------------------

    def _can_draft(self, r: _Row, s: RowSampler) -> bool:
        if self.adaptive and s.options.seed is not None and not s.greedy:
            # Adaptive drafting decisions depend on the batch and on timing; a seeded sampled row
            # stays on plain decoding so its output is the same alone or in any batch.
            return False
        if not r.pending_t:  # a one-token prompt's first step: the head has no pair yet
            return False
        return len(r.history) - r.prompt_len + 1 < s.options.max_tokens  # not at its last token

    def _worth_drafting(self, r: _Row) -> bool:
        """Whether this row alone makes a drafting step worth its head and its wider verify."""
        return not self.adaptive or r.ema >= self.min_row_acceptance or r.idle >= self.probe_every

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
            logits = lm_head(self.head.backbone, h_out)[:, 0]
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

    # -- acceptance -------------------------------------------------------------------------

    def _accept(
        self,
        logits: mx.array,
        drafts: mx.array | None,
        qs: dict[int, mx.array],
        drafting: list[bool],
        samplers: list[RowSampler],
        k: int,
    ) -> tuple[list[list[int]], list[int]]:
        B = len(samplers)
        targets = mx.argmax(logits, axis=-1)  # [B, k+1]
        lazy: dict[int, tuple[mx.array, ...]] = {}
        for i, s in enumerate(samplers):
            if s.greedy:
                continue
            if drafting[i]:
                xp = s.process(logits[i])
                lazy[i] = speculative_row(xp, qs[i], drafts[i], s.next_key(), s.next_key())
            else:
                lazy[i] = (s.sample(logits[i, 0]),)
        mx.eval(targets, drafts if drafts is not None else [], list(lazy.values()))
        t = targets.tolist()
        d = drafts.tolist() if drafts is not None else [[] for _ in range(B)]
        counts, finals = [], []
        for i, s in enumerate(samplers):
            a = 0
            if s.greedy:
                if drafting[i]:
                    while a < k and d[i][a] == t[i][a]:
                        a += 1
                final = t[i][a]
            elif drafting[i]:
                acc, cands = (v.tolist() for v in lazy[i])
                while a < k and acc[a]:
                    a += 1
                final = cands[a]
            else:
                final = lazy[i][0].item()
            counts.append(a)
            finals.append(final)
        if not self.per_row_acceptance and any(drafting):
            # Batch-wide all-or-nothing (the host's scheme), for comparison: every row keeps the
            # shortest accepted run; an accepted draft is a valid sample at its position.
            a_min = min(c for c, dr in zip(counts, drafting) if dr)
            finals = [d[i][a_min] if counts[i] > a_min else finals[i] for i in range(B)]
            counts = [min(c, a_min) for c in counts]
        tokens = [d[i][:a] + [f] for i, (a, f) in enumerate(zip(counts, finals))]
        return tokens, [a if dr else 0 for a, dr in zip(counts, drafting)]

    # -- adaptivity and stats ---------------------------------------------------------------

    def _plan_k(self, B: int) -> int:
        if self.max_batch_size is not None and B > self.max_batch_size:
            return 0
        return self.schedule.choose(B) if self.adaptive else self.k

    def _shape(self, cache: BatchCache, B: int, k: int) -> tuple[int, ...]:
        """What a step's kernels are specialized on: the batch, the draft count and the KV
        buffers' capacities (a grown buffer is a copy, and on CUDA a new attention plan)."""
        kv = next((c for c in cache.layers if isinstance(c, RaggedKVCache)), None)
        caps = [c.keys.shape[2] if c is not None and c.keys is not None else 0 for c in (kv, self._cache[0])]
        return (B, k, *caps)

    def _record(
        self, cache: BatchCache, B: int, k: int, drafting: list[bool], accepted: list[int], tokens: int,
        seconds: float,
    ) -> None:
        if k:
            self.steps_with_mtp += 1
        else:
            self.steps_without_mtp += 1
        for r, d, a in zip(self._rows, drafting, accepted):
            if d:
                self.drafted += k
                self.accepted += a
                self.accepted_histogram[a] += 1
                r.ema = 0.5 * r.ema + 0.5 * (a / k)
                r.idle = 0
            else:
                r.idle += 1
        caught_up, self._caught_up = self._caught_up, False
        if not self.adaptive or (self.max_batch_size is not None and B > self.max_batch_size):
            return
        # Timed only in a steady run: the step before had the same shape. The first step of a
        # shape compiles, traces or plans (CUDA) and the first after a switch pays for the
        # switch (the previous step's work still in flight, the head resuming after plain steps);
        # that is what a switch costs, not what a draft count costs per step.
        shape = self._shape(cache, B, k)
        steady, self._last_shape = shape == self._last_shape, shape
        if steady and not caught_up and seconds is not None:
            self.schedule.record(B, k, tokens / B, seconds / B)

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
            "adaptive": self.adaptive,
            "throughput_by_batch": self.schedule.throughput_by_batch(),
            "draft_count_by_batch": self.schedule.choice_by_batch(),
        }
