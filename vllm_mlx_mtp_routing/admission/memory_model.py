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
    - one decode step's working set (logits in float32 over the vocabulary for 1 + draft tokens).
  transient (prefill only; `Ticket.prefill_done()` gives it back)
    - the worst prefill chunk's working set: activations of one layer of each kind plus the
      residual stream, the chunk's logits (mlx computes lm_head over the whole chunk before the
      last row is sliced), the attention scores [heads, C, L] with a causal mask [C, L], which mlx's
      sdpa fallback materializes (always on CPU; on Metal unless its fused kernel covers the head
      dim, which is not assumed for Qwen3.5's 256 - pass fused_attention=True to drop the term),
      and, off Metal, mlx-vlm's chunked gated-delta scan: float32 [Hv, T padded to 64, 64] blocks
      (decay ratios, K K^T, the triangular inverse and its temporaries) plus float32 q, k, v copies.
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
        return cls(
            num_full_attention_layers=n_full,
            num_linear_layers=n_layers - n_full,
            num_mtp_layers=n_mtp,
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size", 4 * hidden)),
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
        recurrent = (
            self.linear_num_value_heads
            * self.linear_value_head_dim
            * self.linear_key_head_dim
            * self.state_dtype_bytes
        )
        return self.num_linear_layers * (conv + recurrent)

    @property
    def activation_bytes_per_token(self) -> int:
        """Prefill activations per chunk token: the residual stream plus one layer of each kind.

        Lazy graphs free a layer's buffers only as later ops consume them, so one layer of each
        kind alive at once is the bound used (it matched measured peaks on the CPU backend).
        """
        d, f = self.dtype_bytes, _FLOAT32
        h, hv = self.hidden_size, self.linear_num_value_heads
        residual = 3 * h * d
        linear = 0
        if self.num_linear_layers:
            linear = d * (
                4 * self._conv_dim  # in_proj_qkv, conv input, conv output, silu
                + 3 * self._value_dim  # z, delta-rule output, gated norm output
                + 2 * hv  # a, b
                + 2 * self._key_dim  # normalized q, k
                + 2 * hv * self.linear_key_head_dim  # q, k repeated to the value heads
                + h  # out_proj
            ) + f * (2 * hv + 2 * self._value_dim)  # g, beta and the float32 gated norm
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        full = d * (2 * q + 2 * kv + q + kv + 2 * q + h)  # q+gate, k, v, normed/roped, out, gate, o_proj
        mlp = d * (3 * self.intermediate_size + h)
        return residual + linear + full + mlp

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
        logits = c * self.vocab_size * self.dtype_bytes
        return c * self.activation_bytes_per_token + scores + logits + self._delta_scan_bytes(c)

    def _delta_scan_bytes(self, chunk_tokens: int) -> int:
        blk = self.delta_scan_block
        if not blk or not self.num_linear_layers or chunk_tokens <= 1:
            return 0
        padded = -(-chunk_tokens // blk) * blk
        per_token = 10 * blk + 2 * (2 * self.linear_key_head_dim + self.linear_value_head_dim)
        return self.linear_num_value_heads * padded * per_token * _FLOAT32

    def decode_working_set(self) -> int:
        tokens = 1 + self.draft_tokens
        return tokens * (self.vocab_size * _FLOAT32 + self.activation_bytes_per_token)

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
        transient += self._worst_prefill_working_set(prompt_tokens)
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
