"""The decode batch's cache: per-row KV lengths and per-row gated-delta state.

Rows are left-aligned: row i keeps its keys/values at positions [0, lengths[i]) of the layer's
buffer and its RoPE offset is lengths[i], so a row is addressed by one integer, rows of any length
share a forward pass, and rolling a row back by n tokens (speculative decoding) is lengths[i] -= n.
Nothing is ever padded in front of a row, so no position, mask or recurrent state can absorb
padding (the fault of mlx-lm 0.31.3's right-padded batch prefill; see batch.py).

The gated-delta layers keep mlx-lm's ``ArraysCache`` ([conv state, recurrent state], batch on
axis 0) with ``lengths``/``left_padding`` left at None, so the model runs them unmasked, exactly as
single-sequence generation does. Rows are joined and dropped here by concatenation and indexing;
``ArraysCache.merge``/``extend`` are avoided on purpose (merge sets ``left_padding``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, _BaseCache


def _round_up(n: int, step: int) -> int:
    return max(step, (n + step - 1) // step * step)


def _plans_attention_per_shape() -> bool:
    """MLX's CUDA backend runs multi-token-query attention through cuDNN, planned per shape."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


class RaggedKVCache(_BaseCache):
    """A batch KV cache whose rows have their own lengths (drop-in for mlx-lm attention layers).

    ``whole_buffer``: attention reads the whole reserved buffer (its length changes every
    ``step`` tokens) instead of the rows' longest length (every token). On by default where
    attention kernels are planned per shape (cuDNN's SDPA, which MLX's CUDA backend takes for
    multi-token queries such as a [B, k+1] verify): planning anew at every step cost ~70 ms per
    step on an H100 (benchmarks/gpu_step_trace.py). Elsewhere the masked tail would be wasted work.
    """

    step = 256

    def __init__(self, whole_buffer: bool | None = None) -> None:
        self.whole_buffer = _plans_attention_per_shape() if whole_buffer is None else whole_buffer
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._lengths: list[int] = []
        # Positions skipped per row (``skip_rows``): a row's RoPE offset is lengths[i] + shift[i].
        self._shift: list[int] = []
        self._slots = mx.array([], dtype=mx.int32)  # where row i writes its next key
        self.offset = mx.array([], dtype=mx.int32)  # per-row RoPE offset, read by the attention

    @property
    def lengths(self) -> list[int]:
        return list(self._lengths)

    @property
    def batch_size(self) -> int:
        return len(self._lengths)

    def size(self) -> int:
        return max(self._lengths, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def _set_lengths(self, lengths: list[int], shift: list[int] | None = None) -> None:
        self._lengths = list(lengths)
        if shift is not None:
            self._shift = list(shift)
        self._slots = mx.array(self._lengths, dtype=mx.int32)
        if any(self._shift):
            self.offset = mx.array([n + s for n, s in zip(self._lengths, self._shift)], dtype=mx.int32)
        else:
            self.offset = self._slots

    def _capacity(self, needed: int) -> int:
        have = 0 if self.keys is None else self.keys.shape[2]
        return have if needed <= have else _round_up(needed, self.step)

    def _visible(self, needed: int) -> int:
        """How many key slots attention reads once ``needed`` are in use."""
        return self._capacity(needed) if self.whole_buffer else needed

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported")
        # Query q of row i sits in slot lengths[i] + q and sees the keys in slots <= its own.
        q_pos = self._slots[:, None] + mx.arange(N)
        k_pos = mx.arange(self._visible(self.size() + N))
        return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]

    def _reserve(self, needed: int, keys: mx.array, values: mx.array) -> None:
        B, H, _, Dk = keys.shape
        Dv = values.shape[3]
        have = 0 if self.keys is None else self.keys.shape[2]
        if needed <= have:
            return
        grow = self._capacity(needed) - have
        # Zeros, never garbage: masked slots still enter the attention matmul (0 * NaN = NaN).
        new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
        new_v = mx.zeros((B, H, grow, Dv), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        end = self.size() + S
        self._reserve(end, keys, values)
        # In bounds by _reserve: MLX (0.32.4, CPU) does not bounds-check scatters, and an index
        # past the buffer corrupts the heap instead of raising.
        pos = (self._slots[:, None] + mx.arange(S))[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, pos, keys, axis=2)
        self.values = mx.put_along_axis(self.values, pos, values, axis=2)
        self._set_lengths([n + S for n in self._lengths])
        n = self._visible(end)
        return self.keys[..., :n, :], self.values[..., :n, :]

    def trim_rows(self, counts: list[int]) -> None:
        """Forget the last counts[i] tokens of row i (per-row rollback)."""
        self._set_lengths([max(0, n - c) for n, c in zip(self._lengths, counts)])

    def skip_rows(self, counts: list[int]) -> None:
        """Advance row i's positions by counts[i] without storing keys for them: the next token
        of the row is rotated as if the skipped ones were there (the MTP head resuming after
        plain decode steps leaves such a gap instead of catching up on every skipped pair)."""
        if any(counts):
            self._set_lengths(self._lengths, [s + c for s, c in zip(self._shift, counts)])

    def filter(self, keep: list[int]) -> None:
        self._set_lengths([self._lengths[i] for i in keep], [self._shift[i] for i in keep])
        if self.keys is None:
            return
        if not keep:
            self.keys = self.values = None
            return
        idx = mx.array(keep)
        cap = _round_up(self.size(), self.step)
        self.keys = self.keys[idx, :, :cap]
        self.values = self.values[idx, :, :cap]

    def add_row(self, cache: KVCache, shift: int = 0) -> None:
        """Append a batch-1 single-sequence cache as a new row; ``shift``: positions the row's next
        token sits past its keys (a sparse prefill)."""
        self._add_row(cache)
        if shift:
            self.skip_rows([0] * (self.batch_size - 1) + [shift])

    def _add_row(self, cache: KVCache) -> None:
        n = cache.offset
        if cache.keys is None or n == 0:
            if self.keys is not None:
                B, H, T, Dk = self.keys.shape
                self.keys = mx.concatenate([self.keys, mx.zeros((1, H, T, Dk), self.keys.dtype)])
                Dv = self.values.shape[3]
                self.values = mx.concatenate(
                    [self.values, mx.zeros((1, H, T, Dv), self.values.dtype)]
                )
            self._set_lengths(self._lengths + [0], self._shift + [0])
            return
        k, v = cache.keys[..., :n, :], cache.values[..., :n, :]
        cap = _round_up(max(n, self.size()), self.step)
        k = mx.pad(k, [(0, 0), (0, 0), (0, cap - n), (0, 0)])
        v = mx.pad(v, [(0, 0), (0, 0), (0, cap - n), (0, 0)])
        if self.keys is None:
            B = self.batch_size
            old_k = mx.zeros((B, *k.shape[1:]), k.dtype)
            old_v = mx.zeros((B, *v.shape[1:]), v.dtype)
        else:
            have = self.keys.shape[2]
            pad = [(0, 0), (0, 0), (0, cap - have), (0, 0)]
            old_k = mx.pad(self.keys, pad) if cap > have else self.keys[..., :cap, :]
            old_v = mx.pad(self.values, pad) if cap > have else self.values[..., :cap, :]
        self.keys = mx.concatenate([old_k, k])
        self.values = mx.concatenate([old_v, v])
        self._set_lengths(self._lengths + [n], self._shift + [0])

    def extract(self, i: int) -> KVCache:
        """Row i as a single-sequence ``KVCache`` (e.g. to keep it as a prefix cache)."""
        if self._shift[i]:
            raise ValueError("a row with skipped positions has no single-sequence form")
        c = KVCache()
        n = self._lengths[i]
        if self.keys is not None and n:
            c.keys = mx.contiguous(self.keys[i : i + 1, :, :n])
            c.values = mx.contiguous(self.values[i : i + 1, :, :n])
            c.offset = n
        return c


def _gated_delta_zero_state(layer: nn.Module, dtype: mx.Dtype) -> list[mx.array]:
    """What a GatedDeltaNet starts from when its cache is empty (qwen3_5/qwen3_next layout)."""
    lin = layer.linear_attn
    conv = mx.zeros((1, lin.conv_kernel_size - 1, lin.conv_dim), dtype=dtype)
    rec = mx.zeros((1, lin.num_v_heads, lin.head_v_dim, lin.head_k_dim), dtype=mx.float32)
    return [conv, rec]


class BatchCache:
    """Per-layer caches of the running decode batch, rows in the batch's row order."""

    def __init__(self, model: nn.Module, whole_buffer: bool | None = None) -> None:
        self._model = model
        single = model.make_cache()
        for c in single:
            if type(c) not in (ArraysCache, KVCache):
                raise TypeError(f"no batched form for cache type {type(c).__name__}")
        self.layers: list[Any] = [
            ArraysCache(size=len(c.cache)) if isinstance(c, ArraysCache) else RaggedKVCache(whole_buffer)
            for c in single
        ]
        self._rows = 0
        self._act_dtype: mx.Dtype | None = None

    @property
    def batch_size(self) -> int:
        return self._rows

    def lengths(self) -> list[int]:
        """Tokens held per row (the KV length of the full-attention layers)."""
        for c in self.layers:
            if isinstance(c, RaggedKVCache):
                return c.lengths
        raise RuntimeError("the model has no attention layer")

    def _activation_dtype(self) -> mx.Dtype:
        if self._act_dtype is None:
            self._act_dtype = self._model.model.embed_tokens(mx.array([[0]])).dtype
        return self._act_dtype

    def add_row(self, row_cache: list[Any], shift: int = 0) -> None:
        """Append a batch-1 prefilled cache (from ``model.make_cache()``) as the last row."""
        for layer, c, rc in zip(self._model.layers, self.layers, row_cache):
            if isinstance(c, RaggedKVCache):
                c.add_row(rc, shift)
                continue
            row = rc.cache if rc.cache[0] is not None else _gated_delta_zero_state(
                layer, self._activation_dtype()
            )
            if self._rows == 0:
                c.cache = list(row)
            else:
                c.cache = [mx.concatenate([a, b]) for a, b in zip(c.cache, row)]
        self._rows += 1

    def filter(self, keep: list[int]) -> None:
        """Keep only these rows, in this order."""
        idx = mx.array(keep) if keep else None
        for c in self.layers:
            if isinstance(c, RaggedKVCache):
                c.filter(keep)
            else:
                c.cache = [None if (a is None or idx is None) else a[idx] for a in c.cache]
        self._rows = len(keep)

    def state(self) -> list[Any]:
        return [c.state for c in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)
