"""Qwen3.5 multi-token-prediction (MTP) head, the backbone forward that feeds it, and a
single-sequence greedy speculative decode loop (the reference for the batched engine).

The head predicts the token at t+2 from the backbone's hidden state at t and the token at t+1:

    x = fc(concat([pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(hidden_t)]))
    x = layers(x)        # full-attention decoder layer(s) with their own KV cache
    logits = lm_head(norm(x))   # the backbone's lm_head (or tied embedding)

The order (embedding first, hidden second) is that of the Qwen3.5 checkpoints, vllm-mlx's
`mtp_forward` and mlx-vlm's Qwen3.5 drafter. The hidden state is the backbone's post-final-norm
output unless the config says `mtp_hidden_state_mode: pre_norm`.

Positions: the pair (hidden_t, token_{t+1}) is rotated at position t, as mlx-vlm's drafter and
vLLM's MTP proposer do. The head's KV cache therefore holds one entry per backbone position, and
its offset is the RoPE position: prefill the head over the whole prompt (pairs
(h_0, p_1) ... (h_{n-1}, x_n)), then append one pair per verified token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModel, TextModelArgs

HIDDEN_STATE_MODES = ("post_norm", "pre_norm")


def resolve_hidden_state_mode(config: dict) -> str:
    """`mtp_hidden_state_mode` from text_config or the top level; post_norm when absent."""
    text_config = config.get("text_config", config)
    mode = text_config.get("mtp_hidden_state_mode", config.get("mtp_hidden_state_mode", "post_norm"))
    if mode not in HIDDEN_STATE_MODES:
        raise ValueError(f"unsupported mtp_hidden_state_mode={mode!r} (expected one of {HIDDEN_STATE_MODES})")
    return mode


def lm_head(text_model: TextModel, h: mx.array) -> mx.array:
    if text_model.args.tie_word_embeddings:
        return text_model.model.embed_tokens.as_linear(h)
    return text_model.lm_head(h)


# --------------------------------------------------------------------------------------------
# Backbone forward returning the hidden state the head consumes
# --------------------------------------------------------------------------------------------


def _run_layers(
    text_model: TextModel,
    inputs: mx.array,
    cache: Sequence[Any] | None,
    input_embeddings: mx.array | None = None,
    checkpoints: list[list[list[Any]]] | None = None,
) -> mx.array:
    """The decoder stack of mlx-lm 0.31.3's Qwen3_5TextModel.__call__ (uses its fa_idx/ssm_idx/
    is_linear internals), returning the pre-final-norm hidden state.

    With `checkpoints` (a list, batch 1, no padding), each linear (gated-delta) layer runs one token
    at a time and checkpoints[i] receives, per linear layer, a copy of its cache state after
    token i. A gated-delta layer is token-wise except for its conv and recurrent state, both carried
    by the cache, so running it token by token is the same computation; it yields the states a
    rejected draft rolls back to without re-running the accepted tokens.
    """
    inner = text_model.model
    h = inner.embed_tokens(inputs) if input_embeddings is None else input_embeddings
    if cache is None:
        cache = [None] * len(inner.layers)
    fa_mask = create_attention_mask(h, cache[inner.fa_idx])
    ssm_mask = create_ssm_mask(h, cache[inner.ssm_idx])
    L = h.shape[1]
    if checkpoints is not None:
        if h.shape[0] != 1 or ssm_mask is not None or cache[0] is None:
            raise ValueError("checkpointed forward needs batch 1, a cache and no padding")
        checkpoints.extend([] for _ in range(L))
    for layer, c in zip(inner.layers, cache):
        if not layer.is_linear:
            h = layer(h, mask=fa_mask, cache=c)
        elif checkpoints is None:
            h = layer(h, mask=ssm_mask, cache=c)
        else:
            outs = []
            for i in range(L):
                outs.append(layer(h[:, i : i + 1], mask=None, cache=c))
                checkpoints[i].append(list(c.state))
            h = mx.concatenate(outs, axis=1)
    return h


def forward_with_hidden(
    text_model: TextModel,
    inputs: mx.array,
    cache: Sequence[Any] | None = None,
    *,
    hidden_state_mode: str = "post_norm",
    input_embeddings: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """One backbone pass returning (logits, hidden), hidden being what the MTP head consumes."""
    pre = _run_layers(text_model, inputs, cache, input_embeddings)
    post = text_model.model.norm(pre)
    return lm_head(text_model, post), (pre if hidden_state_mode == "pre_norm" else post)


def verify_forward(
    text_model: TextModel,
    inputs: mx.array,
    cache: Sequence[Any],
    *,
    hidden_state_mode: str = "post_norm",
) -> tuple[mx.array, mx.array, list[list[list[Any]]]]:
    """`forward_with_hidden` for batch 1 that also returns, for every position i, the gated-delta
    cache states after token i (see `rollback`)."""
    checkpoints: list[list[list[Any]]] = []
    pre = _run_layers(text_model, inputs, cache, checkpoints=checkpoints)
    post = text_model.model.norm(pre)
    return lm_head(text_model, post), (pre if hidden_state_mode == "pre_norm" else post), checkpoints


def rollback(cache: Sequence[Any], checkpoints: list[list[list[Any]]], keep: int) -> None:
    """Keep only the first `keep` tokens of the last `verify_forward` in the backbone cache:
    KV caches are trimmed, gated-delta caches get the state saved after token keep-1."""
    drop = len(checkpoints) - keep
    if drop <= 0:
        return
    states = iter(checkpoints[keep - 1])
    for c in cache:
        if isinstance(c, ArraysCache):
            c.state = list(next(states))
        else:
            c.trim(drop)


# --------------------------------------------------------------------------------------------
# The head
# --------------------------------------------------------------------------------------------


class MTPHead(nn.Module):
    def __init__(self, args: TextModelArgs, num_layers: int = 1, hidden_state_mode: str = "post_norm"):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        # Any layer_idx with (idx + 1) % full_attention_interval == 0 is a full-attention layer.
        fa_idx = args.full_attention_interval - 1
        self.layers = [DecoderLayer(args, layer_idx=fa_idx) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=eps)
        self.hidden_state_mode = hidden_state_mode
        # A plain object, so the backbone's parameters do not become this module's children.
        self._backbone = SimpleNamespace(model=None)

    def bind(self, text_model: TextModel) -> "MTPHead":
        """Share the backbone's token embedding and lm_head (never copied)."""
        self._backbone.model = text_model
        return self

    @property
    def backbone(self) -> TextModel:
        if self._backbone.model is None:
            raise RuntimeError("MTPHead.bind(text_model) has not been called")
        return self._backbone.model

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def forward(
        self, hidden: mx.array, tokens: mx.array, cache: Sequence[Any] | None = None
    ) -> tuple[mx.array, mx.array]:
        """Pairs (hidden[:, i], tokens[:, i]) -> (normed output, pre-norm output), both [B, L, H].

        hidden: backbone hidden at positions t..t+L-1; tokens: the tokens at t+1..t+L.
        """
        e = self.pre_fc_norm_embedding(self.backbone.model.embed_tokens(tokens))
        x = self.fc(mx.concatenate([e, self.pre_fc_norm_hidden(hidden)], axis=-1))
        if cache is None:
            cache = [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=create_attention_mask(x, c), cache=c)
        return self.norm(x), x

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: Sequence[Any] | None = None) -> mx.array:
        """Logits for the tokens at t+2..t+L+1, [B, L, V]."""
        return lm_head(self.backbone, self.forward(hidden, tokens, cache)[0])

    def draft(self, hidden: mx.array, tokens: mx.array, cache: Sequence[Any], k: int = 1) -> mx.array:
        """Greedy draft of k tokens, [B, k].

        hidden/tokens ([B, L, H] / [B, L]) are the pairs verified since the last call (the whole
        prompt on the first call); they are appended to `cache`. The first draft comes from the
        last pair; each further draft feeds the head its own output hidden state and previous
        draft (mlx-vlm's recursion). Those k-1 speculative entries are trimmed before returning,
        so the cache only ever holds pairs built from backbone hidden states.
        """
        out, pre = self.forward(hidden, tokens, cache)
        tok = mx.argmax(lm_head(self.backbone, out[:, -1:]), axis=-1)
        drafts = [tok]
        for _ in range(k - 1):
            h = pre[:, -1:] if self.hidden_state_mode == "pre_norm" else out[:, -1:]
            out, pre = self.forward(h, tok, cache)
            tok = mx.argmax(lm_head(self.backbone, out), axis=-1)
            drafts.append(tok)
        for c in cache:
            c.trim(k - 1)
        return mx.concatenate(drafts, axis=1)


# --------------------------------------------------------------------------------------------
# Single-sequence greedy speculative decoding (reference implementation)
# --------------------------------------------------------------------------------------------


class Drafter(Protocol):
    def make_cache(self) -> list[Any]: ...

    def draft(self, hidden: mx.array, tokens: mx.array, cache: Sequence[Any], k: int = 1) -> mx.array: ...


@dataclass
class DecodeResult:
    tokens: list[int]
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def _finish(out: list[int], new: Sequence[int], max_tokens: int, eos: set[int]) -> bool:
    """Append new tokens up to max_tokens or the first EOS; True when generation is over."""
    for t in new:
        out.append(t)
        if len(out) >= max_tokens or t in eos:
            return True
    return False


def greedy_generate(
    text_model: TextModel,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
) -> DecodeResult:
    """Plain greedy decoding, one token per forward: the baseline MTP decoding must equal."""
    cache = text_model.make_cache()
    eos = set(eos_token_ids)
    logits = text_model(mx.array([list(prompt)]), cache=cache)
    out: list[int] = []
    while True:
        tok = int(mx.argmax(logits[0, -1]).item())
        if _finish(out, [tok], max_tokens, eos):
            return DecodeResult(out)
        logits = text_model(mx.array([[tok]]), cache=cache)


def mtp_greedy_generate(
    text_model: TextModel,
    drafter: Drafter,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    k: int = 1,
    eos_token_ids: Sequence[int] = (),
    hidden_state_mode: str = "post_norm",
) -> DecodeResult:
    """Greedy decoding with MTP speculation, batch 1: draft k tokens, verify [token, drafts] in
    one backbone forward, accept the longest matching prefix plus the backbone's own next token.

    On rejection the backbone cache keeps the first a+1 verified positions: KV caches are trimmed
    and each gated-delta layer takes the state saved after that position (`verify_forward`), so
    nothing is recomputed. The head's cache never holds unverified entries (see MTPHead.draft).
    The output equals `greedy_generate` token for token (up to floating-point ties).
    """
    if max_tokens <= 0:
        return DecodeResult([])
    cache = text_model.make_cache()
    mtp_cache = drafter.make_cache()
    eos = set(eos_token_ids)
    prompt = list(prompt)

    logits, hidden = forward_with_hidden(
        text_model, mx.array([prompt]), cache, hidden_state_mode=hidden_state_mode
    )
    x = int(mx.argmax(logits[0, -1]).item())
    result = DecodeResult([])
    if _finish(result.tokens, [x], max_tokens, eos):
        return result
    pair_hidden, pair_tokens = hidden, prompt[1:] + [x]

    while True:
        drafts = drafter.draft(pair_hidden, mx.array([pair_tokens]), mtp_cache, k)[0].tolist()
        logits, hidden, checkpoints = verify_forward(
            text_model, mx.array([[x] + drafts]), cache, hidden_state_mode=hidden_state_mode
        )
        target = mx.argmax(logits[0], axis=-1).tolist()
        a = 0
        while a < k and drafts[a] == target[a]:
            a += 1
        rollback(cache, checkpoints, keep=a + 1)
        new = target[: a + 1]
        result.drafted += k
        result.accepted += a
        result.verify_steps += 1
        result.accepted_per_step.append(a)
        if _finish(result.tokens, new, max_tokens, eos):
            return result
        pair_hidden, pair_tokens = hidden[:, : a + 1], new
        x = new[-1]
