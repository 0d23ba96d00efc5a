"""Token importance from a small draft model (Liu et al., "Speculative Prefill", ICML 2025).

The draft prefills the prompt but its last token, then decodes ``look_ahead`` tokens greedily
starting from that last token. Each of those tokens' queries, at every attention layer of the
draft, attends over the prompt: softmax over the keys it sees, averaged over a ``pool_kernel``
window of positions, maximum over layers and heads, mean over the look-ahead tokens. The prompt is
cut into ``chunk_tokens`` chunks from the start of the scored region; the chunks with the highest
mean score are kept (plus ``backbone_pct`` of them evenly spaced, and always the last chunk, whose
final token the first decode step continues from).

Queries are taken from the draft's own attention modules (``q_proj``, the output gate split off
where there is one as in Qwen3.5, ``q_norm`` where present, the module's RoPE at the token's
position), computed beside the layer's normal call on its input: nothing on the draft is patched.

``ScoringJob`` does this in pieces (draft prefill chunks, then the look-ahead and the selection)
so the text engine can run them between decode steps of its batch.
"""

from __future__ import annotations

import math
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .settings import SpecPrefillSettings


class DraftUnsupported(ValueError):
    """The draft's architecture has no attention layer this module can read queries from."""


def prepare_draft(draft: nn.Module) -> nn.Module:
    """Give a Qwen3.5-style draft's gated-delta layers the fused CUDA recurrence (as the target's
    get in text_model.py; nothing changes off CUDA): mlx-lm's per-position loop there would make
    the draft's prefill cost about what the target's does. Same arithmetic to rounding. Idempotent."""
    from ..model.kernels.swaps import use_fused_recurrence

    draft.train(False)  # a module built in code starts in training mode, where no recurrence kernel runs
    use_fused_recurrence(text_model(draft))  # layers without a gated-delta layer are left as they are
    return draft


def text_model(draft: nn.Module) -> nn.Module:
    """The draft's language model (an mlx-lm VLM wrapper keeps it under ``language_model``)."""
    return cast(nn.Module, getattr(draft, "language_model", draft))


def attention_layers(draft: nn.Module) -> list[int]:
    """Indices of the draft's full-attention layers; DraftUnsupported when there is none or one
    whose queries cannot be read."""
    layers = text_model(draft).model.layers
    found = [i for i, layer in enumerate(layers) if getattr(layer, "self_attn", None) is not None and not getattr(layer, "is_linear", False)]
    if not found:
        raise DraftUnsupported("the draft model has no full-attention layer to score the prompt with")
    for i in found:
        attn = layers[i].self_attn
        missing = [a for a in ("q_proj", "k_proj", "rope") if not hasattr(attn, a)]
        if missing or _heads(attn) is None or not hasattr(layers[i], "input_layernorm"):
            raise DraftUnsupported(f"layer {i}'s attention ({type(attn).__name__}) has no {missing or 'head counts'} to read queries from")
    return found


def _heads(attn: nn.Module) -> tuple[int, int] | None:
    q = getattr(attn, "num_attention_heads", None) or getattr(attn, "n_heads", None)
    kv = getattr(attn, "num_key_value_heads", None) or getattr(attn, "n_kv_heads", None)
    return (int(q), int(kv)) if q and kv else None


def queries(attn: nn.Module, x: mx.array, offset: int) -> mx.array:
    """The attention's queries for ``x`` ([1, L, hidden], already input-normed) at positions
    offset.. -> [1, Hq, L, D], rotated as the module rotates them."""
    B, L, _ = x.shape
    heads = _heads(attn)
    assert heads is not None  # attention_layers checked every scored layer
    Hq, _ = heads
    q = attn.q_proj(x).reshape(B, L, Hq, -1)
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is not None and q.shape[-1] == 2 * head_dim:  # Qwen3.5 / Qwen3-Next: [query | output gate]
        q = mx.split(q, 2, axis=-1)[0]
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    return attn.rope(q.transpose(0, 2, 1, 3), offset=offset)


def _lm_head(tm: nn.Module, h: mx.array) -> mx.array:
    head = getattr(tm, "lm_head", None)
    return head(h) if head is not None else tm.model.embed_tokens.as_linear(h)


def _layer_masks(tm: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    """The mask each layer takes for this input (its cache builds it, as the model's forward does)."""
    from ..model.mlx_lm_internals import create_attention_mask, create_ssm_mask

    out = []
    for layer, c in zip(tm.model.layers, cache):
        out.append(create_ssm_mask(h, c) if getattr(layer, "is_linear", False) else create_attention_mask(h, c))
    return out


def lookahead_queries(draft: nn.Module, cache: list[Any], first_token: int, steps: int, layers: list[int]) -> list[mx.array]:
    """Feed ``first_token`` and then ``steps - 1`` greedy draft tokens one at a time; per attention
    layer, the queries of those ``steps`` tokens, [1, Hq, steps, D]."""
    tm = text_model(draft)
    wanted = set(layers)
    got: dict[int, list[mx.array]] = {i: [] for i in layers}
    token = mx.array([[first_token]], dtype=mx.uint32)
    for step in range(steps):
        h = tm.model.embed_tokens(token)
        for i, (layer, c, mask) in enumerate(zip(tm.model.layers, cache, _layer_masks(tm, h, cache))):
            if i in wanted:
                got[i].append(queries(layer.self_attn, layer.input_layernorm(h), c.offset))
            h = layer(h, mask, c)
        if step + 1 < steps:  # left lazy: the look-ahead is one graph, evaluated by its reader
            token = mx.argmax(_lm_head(tm, tm.model.norm(h[:, -1:])), axis=-1).astype(mx.uint32)
    return [mx.concatenate(got[i], axis=2) for i in layers]


def write_kv(attn: nn.Module, x: mx.array, cache: Any) -> None:
    """What the attention module's call writes to ``cache`` for ``x`` (input-normed), without its attention:
    keys normed and rotated, values, as mlx-lm's qwen3 / qwen3_next attention compute them."""
    B, L, _ = x.shape
    heads = _heads(attn)
    assert heads is not None
    keys = attn.k_proj(x).reshape(B, L, heads[1], -1)
    if hasattr(attn, "k_norm"):
        keys = attn.k_norm(keys)
    values = attn.v_proj(x).reshape(B, L, heads[1], -1).transpose(0, 2, 1, 3)
    cache.update_and_fetch(attn.rope(keys.transpose(0, 2, 1, 3), offset=cache.offset), values)


def _keys_only_last_layer(draft: nn.Module) -> bool:
    """Whether ``write_kv`` writes what the draft's last layer writes (probed once per draft, bitwise, on 5
    tokens): then a prompt chunk skips that layer's attention and MLP, whose outputs nothing reads."""
    cached = getattr(draft, "_specprefill_keys_only", None)
    if cached is not None:
        return bool(cached)
    tm = text_model(draft)
    layer = tm.model.layers[-1]
    ok = False
    if getattr(layer, "self_attn", None) is not None and not getattr(layer, "is_linear", False) and hasattr(layer.self_attn, "v_proj"):
        x = mx.random.normal((1, 5, tm.model.embed_tokens.weight.shape[-1]), key=mx.random.key(0)).astype(tm.model.embed_tokens.weight.dtype)
        full, short = make_prompt_cache(draft)[-1], make_prompt_cache(draft)[-1]
        try:
            from ..model.mlx_lm_internals import create_attention_mask

            layer(x, create_attention_mask(x, full), full)
            write_kv(layer.self_attn, layer.input_layernorm(x), short)
            ok = all(mx.array_equal(a, b).item() for a, b in zip(full.state, short.state))
        except Exception:  # noqa: BLE001 - an attention this does not know: the full layer runs
            ok = False
    draft._specprefill_keys_only = ok  # a plain attribute (not a parameter): the draft lives as long as its answer
    return ok


def prefill_keys(draft: nn.Module, chunk: mx.array, cache: list[Any]) -> None:
    """The draft's decoder stack over a prompt chunk, for its caches only: no full-vocabulary logits (half an attn-0.5b
    draft's FLOPs), and where ``_keys_only_last_layer`` the last layer only writes its keys and values (scoring reads
    the prompt's keys, the look-ahead its keys and values; nothing reads that layer's outputs for the prompt)."""
    tm = text_model(draft)
    if not _keys_only_last_layer(draft):
        tm.model(chunk, cache=cache)
        return
    h = tm.model.embed_tokens(chunk)
    layers = tm.model.layers
    for layer, c, mask in zip(layers[:-1], cache, _layer_masks(tm, h, cache)):
        h = layer(h, mask, c)
    write_kv(layers[-1].self_attn, layers[-1].input_layernorm(h), cache[-1])


# The draft's chunk over the target's is a quarter of their parameter ratio, within [1, 4]: a draft token's matmuls cost
# about draft/target of a target token's, and attention over a long prompt raises the draft's share several times over
# (an attention-only draft reads as many key dims per token as a hybrid target). Past 4x (8192 tokens) chunks gained
# nothing measurable on an H100 (docs/benchmarks.md, SpecPrefill).
MAX_DRAFT_CHUNK_SCALE = 4


def draft_chunk(target_chunk: int, target_params: int, draft_params: int) -> int:
    """The draft's prompt chunk for a target prefilled in ``target_chunk``-token chunks: the draft's costs about one of
    the target's, in fewer, larger launches."""
    scale = target_params // max(1, 4 * draft_params)
    return max(1, target_chunk) * min(MAX_DRAFT_CHUNK_SCALE, max(1, scale))


def _avg_pool(x: mx.array, kernel: int) -> mx.array:
    """Mean over a centred window of ``kernel`` positions along the last axis (shrinking at the ends)."""
    if kernel <= 1:
        return x
    n = x.shape[-1]
    c = mx.concatenate([mx.zeros((*x.shape[:-1], 1), x.dtype), mx.cumsum(x, axis=-1)], axis=-1)
    lo = mx.maximum(mx.arange(n) - kernel // 2, 0)
    hi = mx.minimum(mx.arange(n) + (kernel - kernel // 2), n)
    return (mx.take(c, hi, axis=-1) - mx.take(c, lo, axis=-1)) / (hi - lo).astype(x.dtype)


def importance(draft: nn.Module, cache: list[Any], qs: list[mx.array], layers: list[int], scored: int, kernel: int) -> mx.array:
    """Per-position importance of prompt positions [0, scored), [scored] float32 (see the module)."""
    best = None
    for i, q in zip(layers, qs):
        c = cache[i]
        keys = c.keys[..., : c.offset, :].astype(mx.float32)  # [1, Hkv, T, D]
        _, Hkv, T, D = keys.shape
        _, Hq, A, _ = q.shape
        attn = text_model(draft).model.layers[i].self_attn
        scale = getattr(attn, "scale", D**-0.5)
        qg = q.astype(mx.float32).reshape(1, Hkv, Hq // Hkv, A, D)
        s = (qg * scale) @ keys[:, :, None].swapaxes(-1, -2)  # [1, Hkv, rep, A, T]
        # Look-ahead token a sits at position T - A + a and sees the keys up to it.
        visible = mx.arange(T)[None, :] <= (T - A + mx.arange(A))[:, None]
        s = mx.softmax(mx.where(visible, s, -mx.inf), axis=-1)[..., :scored]
        s = _avg_pool(s.reshape(Hq, A, scored), kernel).max(axis=0)  # [A, scored]: max over heads
        best = s if best is None else mx.maximum(best, s)  # max over layers
    assert best is not None  # at least one attention layer (attention_layers)
    return best.mean(axis=0)


def select_chunks(scores: np.ndarray, start: int, keep_pct: float, backbone_pct: float, chunk: int) -> list[int]:
    """The kept positions (sorted, absolute) of the region [start, start + len(scores)): whole
    ``chunk``-token chunks counted from ``start``, the best by mean score, ``backbone_pct`` of them
    evenly spaced, and always the last one."""
    M = len(scores)
    n_chunks = math.ceil(M / chunk)
    keep_n = min(n_chunks, max(1, math.ceil(n_chunks * keep_pct)))
    means = np.array([scores[j * chunk : (j + 1) * chunk].mean() for j in range(n_chunks)])
    chosen = {n_chunks - 1}
    backbone_n = min(keep_n, math.ceil(n_chunks * backbone_pct)) if backbone_pct > 0 else 0
    for j in range(backbone_n):
        chosen.add(round(j * (n_chunks - 1) / max(1, backbone_n - 1)))
    target = math.ceil(M * keep_pct)  # a short last chunk does not make the kept share fall short

    def size(j: int) -> int:
        return min(M, (j + 1) * chunk) - j * chunk

    for j in np.argsort(-means, kind="stable"):
        if len(chosen) >= keep_n and sum(size(c) for c in chosen) >= target:
            break
        chosen.add(int(j))
    return [p for j in sorted(chosen) for p in range(start + j * chunk, start + min(M, (j + 1) * chunk))]


class ScoringJob:
    """Scores prompt[start:n-1] of one request in pieces (``advance``), on its own draft caches.

    ``kept`` is the result once ``done``; ``scored_tokens`` the draft tokens it processed.
    """

    def __init__(self, draft: nn.Module, prompt_ids: list[int], start: int, keep_pct: float, backbone_pct: float,
                 settings: SpecPrefillSettings, chunk_tokens: int) -> None:
        self.draft = draft
        self.prompt_ids = prompt_ids
        self.start = start
        self.keep_pct = keep_pct
        self.backbone_pct = backbone_pct
        self.settings = settings
        self.chunk_tokens = max(1, chunk_tokens)
        self.layers = attention_layers(prepare_draft(draft))
        self.cache: list[Any] | None = make_prompt_cache(draft)
        self.prefilled = 0  # draft tokens in self.cache
        self.kept: list[int] | None = None
        self.scores: np.ndarray | None = None  # per-position importance of prompt[start:n-1], once done

    @property
    def to_prefill(self) -> int:
        return len(self.prompt_ids) - 1

    @property
    def done(self) -> bool:
        return self.kept is not None

    def next_cost(self) -> int:
        """Tokens the next ``advance`` feeds the draft."""
        if self.prefilled < self.to_prefill:
            return min(self.chunk_tokens - self.prefilled % self.chunk_tokens, self.to_prefill - self.prefilled)
        return self.settings.look_ahead

    def advance(self, overlap: bool = False) -> int:
        """One piece: a draft prefill chunk, or the look-ahead and the selection; tokens fed. ``overlap``: a prefill
        chunk is launched and not waited for, so the next one is built while the device runs it (nothing else waits
        on the device meanwhile: no row decodes)."""
        n = self.next_cost()
        assert self.cache is not None  # advanced only until done
        if self.prefilled < self.to_prefill:
            chunk = mx.array(self.prompt_ids[self.prefilled : self.prefilled + n], dtype=mx.uint32)[None]
            prefill_keys(self.draft, chunk, self.cache)
            (mx.async_eval if overlap else mx.eval)([c.state for c in self.cache])
            self.prefilled += n
            return n
        s = self.settings
        qs = lookahead_queries(self.draft, self.cache, self.prompt_ids[-1], s.look_ahead, self.layers)
        scores = importance(self.draft, self.cache, qs, self.layers, self.to_prefill, s.pool_kernel)
        region = np.array(scores[self.start :].astype(mx.float32))
        if not np.all(np.isfinite(region)):
            raise FloatingPointError("the draft's attention scores are not finite")
        self.scores = region  # kept for a caller that selects again at other shares (benchmarks)
        self.kept = select_chunks(region, self.start, self.keep_pct, self.backbone_pct, s.chunk_tokens)
        self.cache = None  # the draft's caches are not needed past scoring
        return n


def score_tokens(draft: nn.Module, prompt_ids: list[int], keep_pct: float, *, start: int = 0, backbone_pct: float = 0.0,
                 settings: SpecPrefillSettings | None = None, chunk_tokens: int = 2048) -> list[int]:
    """All at once: the positions of prompt[start:len-1] a sparse prefill keeps."""
    job = ScoringJob(draft, list(prompt_ids), start, keep_pct, backbone_pct, settings or SpecPrefillSettings(), chunk_tokens)
    while not job.done:
        job.advance()
    assert job.kept is not None
    return job.kept
