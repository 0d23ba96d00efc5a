"""Bytes one request needs on a Qwen3.5-style hybrid model, computed from the model's config.

What is counted, per request (one batch row):
  persistent (held from admission until release)
    - KV cache of the full-attention layers and of the MTP layers, at the capacity mlx's KVCache
      actually allocates: it grows in 256-token steps, so the prompt's chunks and the decode are
      each rounded up (simulated exactly, see `kv_capacity_tokens`);
    - one full-attention layer's KV again: growing a KVCache concatenates the old buffer into a new
      one, so for a moment a layer's KV exists twice;
    - the gated-delta layers' fixed state: conv state [K-1, conv_dim] in the activation dtype and
      recurrent state [Hv, Dv, Dk] in float32 (mamba_ssm_dtype), independent of length;
    - one decode step's working set (logits in float32 over the vocabulary for 1 + draft tokens; with
      drafts, the verify's gated-delta state after each position, kept until it rolls back).
  transient (prefill only; `Ticket.prefill_done()` gives it back)
    - the worst prefill chunk's working set: what the chunk holds across its layers (the residual
      stream, each gated-delta layer's conv input) plus its largest layer's working set, and the
      chunk's logits where the path computes them (mlx-vlm's: lm_head over the whole chunk before
      the last row is sliced). An attention layer counts its scores [heads, C, L] with a causal mask
      [C, L], which mlx's sdpa fallback materializes (always on CPU; on Metal unless its fused kernel
      covers the head dim, which is not assumed for Qwen3.5's 256 - pass fused_attention=True to drop
      the term); a gated-delta layer, off Metal, mlx-vlm's chunked scan (float32 [Hv, T padded to 64,
      64] blocks: decay ratios, K K^T, the triangular inverse and its temporaries, plus float32 q, k, v
      copies), or on the text engine off the GPU, mlx-lm's recurrent state after every position.
      An MoE layer (Qwen3.5-MoE: `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, a shared
      expert) counts its router scores and, per token, its k experts' gathered inputs and activations
      plus the shared expert's, in place of a dense MLP (MoE configs have no `intermediate_size`).
With `kv_block` set (the text engine, see text_engine/footprint.py) the KV is the engine's block pool
instead: the row's tokens in whole blocks plus the pool's slack (an eighth), and the prefill stage's
single-sequence caches become part of the transient share, given back when the row joins the batch.
Not counted: weights and anything resident before the request (the controller measures those
live), the vision tower (pass `extra_bytes` to the controller), prefix-cache copies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..model.kernels.device import on_metal

logger = logging.getLogger(__name__)

# mlx-lm 0.31.3 / mlx-vlm 0.7.10 KVCache.step: buffers grow by whole multiples of this.
KV_STEP = 256
_FLOAT32 = 4
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_POOL_SLACK = 8  # the text engine's KV pool grows by at least 1/8 and compacts past 1/8 free


def _default_scan_block() -> int:
    return 0 if on_metal() else 64


@dataclass(frozen=True)
class Projection:
    persistent_bytes: int
    transient_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.persistent_bytes + self.transient_bytes


@dataclass(frozen=True)
class MemoryModel:
    num_full_attention_layers: int
    num_linear_layers: int
    num_mtp_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    dtype_bytes: int = 2
    state_dtype_bytes: int = _FLOAT32
    prefill_step_size: int = 2048
    draft_tokens: int = 0
    fused_attention: bool = False
    delta_scan_block: int = 64
    # The text engine's batch KV: a pool of kv_block-token blocks per row (text_engine.batch_cache
    # RaggedKVCache); 0 for mlx's own KVCache (256-token growth steps), as the mlx-vlm path holds.
    kv_block: int = 0
    # Whether a prefill chunk computes logits over all its tokens (mlx-vlm's path does; the text
    # engine's prefill computes none).
    prefill_logits: bool = True
    # Whether the prefill's recurrence keeps one layer's state after every position of a chunk alive at
    # once (mlx-lm's per-position loop off the GPU kernels: each step's output holds its state).
    prefill_position_states: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_model_config(
        cls,
        config: dict[str, Any],
        *,
        dtype_bytes: int | None = None,
        prefill_step_size: int = 2048,
        include_mtp: bool = True,
        draft_tokens: int | None = None,
        fused_attention: bool = False,
        delta_scan_block: int | None = None,
    ) -> MemoryModel:
        """Read a Qwen3.5 (or Qwen3-Next, or plain attention) config.json dict.

        `text_config` is used when present (VLM checkpoints), else the top level. The layer layout
        follows `full_attention_interval`, as mlx-lm and mlx-vlm build it; `layer_types` is only
        cross-checked. `dtype_bytes` defaults to the config's dtype (float32 -> 4, else 2: quantized
        checkpoints still compute in 16 bits). `draft_tokens` defaults to 1 with MTP layers.
        `delta_scan_block` is the chunk of mlx-vlm's gated-delta prefill scan (64), counted unless
        the default device is a Metal GPU, where a fused kernel runs instead (pass 0 or 64 to force).
        """
        text = {**config, **config.get("text_config", {})}
        n_layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        has_linear = "linear_num_value_heads" in text
        if has_linear:
            interval = int(text.get("full_attention_interval", 4))
            n_full = sum(1 for i in range(n_layers) if (i + 1) % interval == 0)
        else:
            n_full = n_layers
        layer_types = text.get("layer_types")
        if has_linear and layer_types and layer_types.count("full_attention") != n_full:
            logger.warning(
                "layer_types has %d full-attention layers but full_attention_interval gives %d; "
                "mlx builds the latter, counting that",
                layer_types.count("full_attention"),
                n_full,
            )
        if dtype_bytes is None:
            name = str(text.get("dtype") or text.get("torch_dtype") or "bfloat16")
            dtype_bytes = _DTYPE_BYTES.get(name, 2)
        n_mtp = int(text.get("mtp_num_hidden_layers", 0) or 0) if include_mtp else 0
        experts = int(text.get("num_experts", 0) or 0)
        return cls(
            num_full_attention_layers=n_full,
            num_linear_layers=n_layers - n_full,
            num_mtp_layers=n_mtp,
            hidden_size=hidden,
            # An MoE config's dense size (absent, or a default of mlx-lm's args) sizes no layer.
            intermediate_size=0 if experts else int(text.get("intermediate_size", 4 * hidden)),
            vocab_size=int(text["vocab_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or hidden // heads),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 0)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 0)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 0)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 0)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 0)),
            dtype_bytes=dtype_bytes,
            prefill_step_size=prefill_step_size,
            draft_tokens=(1 if n_mtp else 0) if draft_tokens is None else draft_tokens,
            fused_attention=fused_attention,
            delta_scan_block=_default_scan_block() if delta_scan_block is None else delta_scan_block,
            num_experts=experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0) if experts else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0) if experts else 0,
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0) if experts else 0,
        )

    # -- per-token and fixed sizes ------------------------------------------------------------

    @property
    def kv_bytes_per_layer_token(self) -> int:
        return 2 * self.num_key_value_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token adds across the full-attention layers and the MTP layers."""
        return (self.num_full_attention_layers + self.num_mtp_layers) * self.kv_bytes_per_layer_token

    @property
    def _key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def _value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def _conv_dim(self) -> int:
        return 2 * self._key_dim + self._value_dim

    @property
    def state_bytes(self) -> int:
        """Fixed recurrent state of all gated-delta layers for one request (conv + recurrent)."""
        conv = max(self.linear_conv_kernel_dim - 1, 0) * self._conv_dim * self.dtype_bytes
        return self.num_linear_layers * (conv + self.recurrent_state_bytes)

    @property
    def recurrent_state_bytes(self) -> int:
        """One gated-delta layer's recurrent state [Hv, Dv, Dk] for one request."""
        return self.linear_num_value_heads * self.linear_value_head_dim * self.linear_key_head_dim * self.state_dtype_bytes

    @property
    def activation_bytes_per_token(self) -> int:
        """Activations per token of the residual stream plus one layer of each kind (a decode step's bound)."""
        return self._stream_bytes_per_token + self._linear_bytes_per_token + self._full_bytes_per_token + self._mlp_bytes_per_token

    @property
    def _stream_bytes_per_token(self) -> int:
        """What a prefill chunk holds across its layers: the residual stream, and every gated-delta layer's
        conv input (its cache's conv state is a slice of it, evaluated only with the chunk's caches)."""
        return 3 * self.hidden_size * self.dtype_bytes + self.num_linear_layers * self._conv_dim * self.dtype_bytes

    # Per-layer working sets below: measured on MLX's CPU backend (mlx-lm's layers, float32 and bfloat16, hidden
    # 64-512) and rounded up; docs/design-notes.md has the numbers.
    @property
    def _linear_bytes_per_token(self) -> int:
        """A gated-delta layer (its recurrent states are counted apart): the projections, conv input and
        output, the delta rule's output and the gated norm, and the float32 gates."""
        if not self.num_linear_layers:
            return 0
        d = self.dtype_bytes
        return d * (2 * self._conv_dim + 2 * self._value_dim + self.hidden_size) + _FLOAT32 * 2 * self.linear_num_value_heads

    @property
    def _full_bytes_per_token(self) -> int:
        """A full-attention layer per chunk token (the scores, and K/V repeated to the query heads, apart)."""
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return self.dtype_bytes * (9 * q + 3 * kv + self.hidden_size)

    @property
    def _mlp_bytes_per_token(self) -> int:
        d, h = self.dtype_bytes, self.hidden_size
        if not self.num_experts:
            return d * (2 * self.intermediate_size + 2 * h)
        e, k = self.num_experts, self.num_experts_per_tok
        # mlx-lm's SwitchGLU: the token's input gathered for each of its k experts, their up, gate and
        # activation, and their down outputs before the weighted sum; the shared expert beside them; the
        # router's logits and softmax, and int32 indices (argpartition's and the sort's).
        routed = k * (2 * self.moe_intermediate_size + 3 * h)
        shared = 2 * self.shared_expert_intermediate_size + 3 * h
        return d * (routed + shared + 2 * e) + 4 * (e + 3 * k)

    # -- sizes that depend on length --------------------------------------------------------

    def prefill_chunks(self, prompt_tokens: int) -> list[int]:
        step = max(self.prefill_step_size, 1)
        full, rest = divmod(max(prompt_tokens, 0), step)
        return [step] * full + ([rest] if rest else [])

    def kv_capacity_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """Tokens of KV buffer a KVCache holds after prefilling in chunks and decoding max_tokens.

        Mirrors KVCache.update_and_fetch: a write that does not fit keeps the buffer up to the
        current offset and appends ceil(new / step) * step slots.
        """
        cap = offset = 0
        for chunk in self.prefill_chunks(prompt_tokens):
            if offset + chunk > cap:
                cap = (offset if offset % KV_STEP else cap) + -(-chunk // KV_STEP) * KV_STEP
            offset += chunk
        decode = max(max_tokens, 0) + self.draft_tokens
        if offset + decode > cap:
            # Decode writes 1 (+ draft) tokens at a time: each growth adds one step.
            cap += -(-(offset + decode - cap) // KV_STEP) * KV_STEP
        return cap

    def prefill_working_set(self, chunk_tokens: int, context_tokens: int | None = None) -> int:
        """Transient bytes while prefilling `chunk_tokens` with `context_tokens` in the KV (incl. the chunk)."""
        c = max(chunk_tokens, 0)
        ctx = c if context_tokens is None else max(context_tokens, c)
        scores = 0
        if not self.fused_attention and self.num_full_attention_layers:
            # softmax and the mask's where() donate the scores buffer, so one copy plus a bool mask
            scores = self.num_attention_heads * c * ctx * self.dtype_bytes + c * ctx
        logits = c * self.vocab_size * self.dtype_bytes if self.prefill_logits else 0
        # Layers run one after another: the largest layer's working set on top of what the chunk holds throughout.
        linear = 0
        if self.num_linear_layers:
            states = self.recurrent_state_bytes if self.prefill_position_states else 0
            linear = c * (self._linear_bytes_per_token + states) + self._delta_scan_bytes(c)
        full = 0
        if self.num_full_attention_layers:
            full = c * self._full_bytes_per_token + 2 * ctx * self.num_attention_heads * self.head_dim * self.dtype_bytes + scores
        layer = max(linear, full, c * self._mlp_bytes_per_token)
        return c * self._stream_bytes_per_token + layer + logits

    def _delta_scan_bytes(self, chunk_tokens: int) -> int:
        blk = self.delta_scan_block
        if not blk or not self.num_linear_layers or chunk_tokens <= 1:
            return 0
        padded = -(-chunk_tokens // blk) * blk
        per_token = 10 * blk + 5 * (2 * self.linear_key_head_dim + self.linear_value_head_dim)
        return self.linear_num_value_heads * padded * per_token * _FLOAT32

    def decode_working_set(self) -> int:
        tokens = 1 + self.draft_tokens
        # A verify of drafts keeps every gated-delta layer's state after each position until it rolls back.
        captured = tokens * self.num_linear_layers * self.recurrent_state_bytes if self.draft_tokens else 0
        return tokens * (self.vocab_size * _FLOAT32 + self.activation_bytes_per_token) + captured

    # -- the projection -------------------------------------------------------------------

    def pooled_kv_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """Tokens of KV a row holds in the text engine's block pool at its longest: the prompt,
        max_tokens and one step's drafts, in whole blocks."""
        need = max(prompt_tokens, 0) + max(max_tokens, 0) + self.draft_tokens
        return -(-need // self.kv_block) * self.kv_block

    def row_cache_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """The text engine's caches for one row at its longest: block-pool KV (plus the pool's
        growth slack, at most an eighth) and the gated-delta state."""
        kv = self.pooled_kv_tokens(prompt_tokens, max_tokens) * self.kv_bytes_per_token
        return kv + kv // _POOL_SLACK + self.state_bytes

    def _project_pooled(self, prompt_tokens: int, max_tokens: int) -> Projection:
        """The text engine: a request prefills alone on mlx's KVCache (256-token steps), then its
        KV moves into the batch's block pool when it joins (``Ticket.prefill_done``)."""
        persistent = self.row_cache_bytes(prompt_tokens, max_tokens) + self.decode_working_set()
        # One attention layer's pool grows by concatenation: for a moment its share exists twice.
        if self.kv_bytes_per_token:
            persistent += self.pooled_kv_tokens(prompt_tokens, max_tokens) * self.kv_bytes_per_layer_token
        prefill_cap = self.kv_capacity_tokens(prompt_tokens, 0) if prompt_tokens > 1 else 0
        transient = prefill_cap * (self.kv_bytes_per_token + self.kv_bytes_per_layer_token)
        # The prefill's working set is gone before the row's batch share is allocated (at the join, beside the
        # prefill caches): only what it needs past that share is counted on top.
        transient += max(self._worst_prefill_working_set(prompt_tokens) - persistent, 0)
        return Projection(persistent, transient)

    def _worst_prefill_working_set(self, prompt_tokens: int) -> int:
        # The working set grows with context, so only the last full chunk and the final partial
        # chunk can be the worst.
        transient, offset = 0, 0
        chunks = self.prefill_chunks(prompt_tokens)
        for i, chunk in enumerate(chunks):
            offset += chunk
            if i >= len(chunks) - 2:
                transient = max(transient, self.prefill_working_set(chunk, offset))
        return transient

    def project_parts(self, prompt_tokens: int, max_tokens: int) -> Projection:
        if self.kv_block:
            return self._project_pooled(prompt_tokens, max_tokens)
        cap = self.kv_capacity_tokens(prompt_tokens, max_tokens)
        growth_copy = cap * self.kv_bytes_per_layer_token if self.kv_bytes_per_token else 0
        persistent = cap * self.kv_bytes_per_token + growth_copy + self.state_bytes + self.decode_working_set()
        return Projection(persistent, self._worst_prefill_working_set(prompt_tokens))

    def project(self, prompt_tokens: int, max_tokens: int) -> int:
        """Upper bound on the bytes one request adds, from admission to completion."""
        return self.project_parts(prompt_tokens, max_tokens).total_bytes
