"""Sparse prefill: the target model prefills only the kept prompt tokens, each at its own position.

mlx-lm's attention rotates a forward's tokens at consecutive positions from its cache's offset, so
kept tokens from several chunks in one forward would be rotated wrongly. Here the Qwen3.5 decoder
stack runs with its attention layers called through ``rotated_layer`` (model/rotated_attention.py): the module's own
projections, norms and RoPE, the RoPE applied with one offset per token (``mx.fast.rope`` takes a
per-batch offset vector; the tokens are laid out as its batch), and the keys appended to the row's
own single-sequence ``KVCache``. The gated-delta layers have no positions and see the kept tokens
only. Nothing on the shared model is changed, so the running batch is never affected.

The result is a ``PrefillState`` covering ``prompt[:n-1]`` (``prefilled`` = n - 1) whose caches
hold the kept tokens and whose ``position`` is n - 1: the decode batch takes the row with its RoPE
offset shifted past the dropped tokens, so decoding continues at the original prompt length. With
an MTP head, the head's cache gets the pairs (hidden_p, token_p+1) of the kept positions p, each
rotated at p, and the pair of the last kept position (always n - 2) waits for the first decode
step, as after a dense prefill.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..model.mlx_lm_internals import create_ssm_mask, ssm_cache_index
from ..model.rotated_attention import rotated_layer
from ..text_engine.state import PrefillState


def rows_per_token(rope: nn.Module, head_dim: int) -> int:
    """Rows each token takes in ``rope_at``'s layout (the token's, then zero rows): at least 16 / (rotated pairs).

    MLX 0.32's CUDA RoPE with one offset per batch entry picks a block of up to 1024 threads over (rotated pairs,
    rows, batch x heads / 4), filling the last axis with what the first two leave: with 8 pairs (head_dim 64 at
    partial rotary 0.25) and one row that is 128 threads along z, over CUDA's limit of 64, and the launch fails
    ("cudaGraphAddKernelNode ... invalid argument"). Rows along the middle axis keep z at 64 or less."""
    pairs = max(1, int(getattr(rope, "dims", head_dim)) // 2)
    return max(1, 16 // (1 << (pairs.bit_length() - 1)))


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """``rope`` applied to x [1, H, L, D] with token l at positions[l] ([L] int32)."""
    _, H, L, D = x.shape
    y = x[0].transpose(1, 0, 2)[:, :, None, :]  # [L, H, 1, D]: one offset per token, the token in row 0
    rows = rows_per_token(rope, D)
    if rows > 1:  # row 0 is rotated at offset + 0 whatever the rows after it: the same arithmetic
        y = mx.concatenate([y, mx.zeros((L, H, rows - 1, D), y.dtype)], axis=2)
    y = rope(y, offset=positions)
    return y[:, :, 0, :].transpose(1, 0, 2)[None]


def _attention_layer(layer: nn.Module, h: mx.array, positions: mx.array, cache: Any) -> mx.array:
    rope = layer.self_attn.rope
    return rotated_layer(layer, h, cache, lambda q, k: (rope_at(rope, q, positions), rope_at(rope, k, positions)))


def positioned_forward(model: nn.Module, tokens: mx.array, positions: mx.array, cache: list[Any],
                       hidden_state_mode: str = "post_norm") -> mx.array:
    """The qwen3_5 decoder stack over tokens [1, L] at positions [L] -> the hidden state the MTP
    head reads (post-norm, or pre-norm), [1, L, H]."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    ssm_mask = create_ssm_mask(h, cache[ssm_cache_index(model)])
    for layer, c in zip(inner.layers, cache):
        h = layer(h, mask=ssm_mask, cache=c) if layer.is_linear else _attention_layer(layer, h, positions, c)
    return h if hidden_state_mode == "pre_norm" else inner.norm(h)


def head_pairs(head: Any, hidden: mx.array, tokens: mx.array, positions: mx.array, cache: list[Any]) -> None:
    """Append the MTP head's pairs (hidden[:, i], tokens[:, i]) at positions[i] to its caches."""
    e = head.pre_fc_norm_embedding(head.backbone.model.embed_tokens(tokens))
    x = head.fc(mx.concatenate([e, head.pre_fc_norm_hidden(hidden)], axis=-1))
    for layer, c in zip(head.layers, cache):
        x = _attention_layer(layer, x, positions, c)


class SparsePrefill:
    """Prefills the kept positions of one prompt on its ``PrefillState``, ``chunk_tokens`` kept tokens
    per ``advance``. ``head``: the MTP head (None: no head caches are filled)."""

    def __init__(self, model: nn.Module, prompt_ids: list[int], kept: list[int], state: PrefillState, *,
                 chunk_tokens: int, head: Any = None, hidden_state_mode: str = "post_norm") -> None:
        n = len(prompt_ids)
        if not kept or kept[-1] != n - 2 or kept[0] < state.prefilled or any(a >= b for a, b in zip(kept, kept[1:])):
            raise ValueError("kept positions must be increasing, past the restored prefix, and end at len(prompt) - 2")
        self.model = model
        self.prompt_ids = prompt_ids
        self.kept = kept
        self.state = state
        self.chunk_tokens = max(1, chunk_tokens)
        self.head = head
        self.hidden_state_mode = hidden_state_mode
        self.done_tokens = 0
        if state.backbone is None:
            state.backbone = model.make_cache()
        # Pairs: the restored state's pending pair sits at prefilled - 1 (its next token is prompt[prefilled]).
        self._pending_at = state.prefilled - 1 if state.head_hidden is not None else None
        self._head_on = head is not None and (state.head is not None or state.prefilled == 0)
        if self._head_on and state.head is None:
            state.head = head.make_cache()

    @property
    def done(self) -> bool:
        return self.done_tokens == len(self.kept)

    def next_cost(self) -> int:
        return min(self.chunk_tokens, len(self.kept) - self.done_tokens)

    def advance(self, overlap: bool = False) -> int:
        """The next chunk of kept tokens; ``overlap``: launched and not waited for (see ``ScoringJob.advance``), but for
        the last, so its time is the prefill's."""
        n = self.next_cost()
        pos = self.kept[self.done_tokens : self.done_tokens + n]
        ids = self.prompt_ids
        state = self.state
        assert state.backbone is not None  # made in __init__
        positions = mx.array(pos, dtype=mx.int32)
        hidden = positioned_forward(self.model, mx.array([ids[p] for p in pos], dtype=mx.uint32)[None], positions,
                                    state.backbone, self.hidden_state_mode)
        arrays = [c.state for c in state.backbone]
        if self.head is not None:
            if self._head_on:
                assert state.head is not None  # made in __init__ when the head is on
                # (hidden_p, token_p+1) at p for the pending pair and every position here but the last.
                hs, at = [hidden[:, :-1]], pos[:-1]
                if self._pending_at is not None:
                    assert state.head_hidden is not None  # the pending pair's hidden state
                    hs.insert(0, state.head_hidden)
                    at = [self._pending_at, *at]
                if at:
                    head_pairs(self.head, mx.concatenate(hs, axis=1), mx.array([[ids[p + 1] for p in at]], dtype=mx.uint32),
                               mx.array(at, dtype=mx.int32), state.head)
                    arrays.append([c.state for c in state.head])
            state.head_hidden = hidden[:, -1:]
            self._pending_at = pos[-1]
            arrays.append(state.head_hidden)
        self.done_tokens += n
        (mx.async_eval if overlap and not self.done else mx.eval)(arrays)
        if self.done:
            state.prefilled = state.position = len(ids) - 1
        return n
