"""Qwen3.5 multi-token-prediction (MTP) head.

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

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .backbone import backbone_forward, lm_head
from .mlx_lm_internals import DecoderLayer, KVCache, TextModel, TextModelArgs, create_attention_mask

HIDDEN_STATE_MODES = ("post_norm", "pre_norm")


def resolve_hidden_state_mode(config: dict) -> str:
    """`mtp_hidden_state_mode` from text_config or the top level; post_norm when absent."""
    text_config = config.get("text_config", config)
    mode = text_config.get("mtp_hidden_state_mode", config.get("mtp_hidden_state_mode", "post_norm"))
    if mode not in HIDDEN_STATE_MODES:
        raise ValueError(f"unsupported mtp_hidden_state_mode={mode!r} (expected one of {HIDDEN_STATE_MODES})")
    return mode


def forward_with_hidden(
    text_model: TextModel,
    inputs: mx.array,
    cache: Sequence[Any] | None = None,
    *,
    hidden_state_mode: str = "post_norm",
    input_embeddings: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """One backbone pass returning (logits, hidden), hidden being what the MTP head consumes."""
    logits, hidden, _ = backbone_forward(
        text_model, inputs, cache, hidden_state_mode=hidden_state_mode, input_embeddings=input_embeddings
    )
    assert logits is not None  # logits=True
    return logits, hidden


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

    def bind(self, text_model: TextModel) -> MTPHead:
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

