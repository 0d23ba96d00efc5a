"""The decode batch's cache: per-row KV lengths and per-row gated-delta state.

Rows are left-aligned: row i keeps its keys/values at positions [0, lengths[i]) (in its own blocks
of the layer's pool, see ``RaggedKVCache``) and its RoPE offset is lengths[i], so rows of any
length share a forward pass, and rolling a row back by n tokens (speculative decoding) is
lengths[i] -= n.
Nothing is ever padded in front of a row, so no position, mask or recurrent state can absorb
padding (the fault of mlx-lm 0.31.3's right-padded batch prefill; see batch.py).

The gated-delta layers keep mlx-lm's ``ArraysCache`` ([conv state, recurrent state], batch on
axis 0) with ``lengths``/``left_padding`` left at None, so the model runs them unmasked, exactly as
single-sequence generation does. Rows are joined and dropped here by concatenation and indexing;
``ArraysCache.merge``/``extend`` are avoided on purpose (merge sets ``left_padding``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

from ..model.backbone import Captured, rollback_rows, zero_state
from ..model.kernels.device import on_cuda, on_gpu
from ..model.kernels.kv_gather import gather_rows
from ..model.mlx_lm_internals import ArraysCache, BaseCache, KVCache
from .length_groups import plan_groups

T = TypeVar("T")


def _round_up(n: int, step: int) -> int:
    return max(step, (n + step - 1) // step * step)


@dataclass(frozen=True)
class RowGroup:
    """Rows that share one attention call (grouped_attention.py)."""

    rows: tuple[int, ...]
    index: mx.array  # the rows as an array: selects their queries, mask and read positions
    span: int  # key positions the call reads


def _plan(spans: list[int], overhead: int) -> tuple[list[RowGroup], mx.array] | None:
    groups = plan_groups(spans, overhead)
    if len(groups) == 1:
        return None
    order = [i for rows in groups for i in rows]
    inverse = sorted(range(len(order)), key=order.__getitem__)
    calls = [RowGroup(tuple(rows), mx.array(rows, dtype=mx.int32), max(spans[i] for i in rows)) for rows in groups]
    return calls, mx.array(inverse, dtype=mx.int32)


class StepArrays:
    """The index arrays every attention layer of one batch derives alike from the rows' lengths and
    block tables, made once and shared.

    Each layer keeps its own pool, but its rows, lengths and tables change in lockstep with every
    other layer's (the batch joins, grows, trims and filters them together), so per step the write
    slots, the read index and the RoPE offsets are the same arrays in every layer. Made per layer,
    they would be several small device ops and a host-to-device copy per attention layer and step,
    which a launch-bound GPU pays per launch. A memo keyed by
    content (lengths, tables) or by the identity of the arrays it derives from keeps a few recent
    entries, enough for one step's layers; an entry keyed by identity holds its sources, so an
    ``id`` is never reused while its entry lives."""

    _KEEP = 16

    def __init__(self) -> None:
        self._memo: dict[tuple, tuple] = {}

    def get(self, key: tuple, make: Callable[[], T], *sources: mx.array) -> T:
        hit = self._memo.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[1], sources)):
            return hit[0]
        value = make()
        if len(self._memo) >= self._KEEP:
            del self._memo[next(iter(self._memo))]
        self._memo[key] = (value, sources)
        return value


def _plans_attention_per_shape() -> bool:
    """MLX's CUDA backend runs multi-token-query attention through cuDNN, planned per shape."""
    return on_cuda()


def default_group_overhead() -> int:
    """``RaggedKVCache.group_overhead`` on MLX's default device: one attention call always on a GPU."""
    return 0 if on_gpu() else 1024


class RaggedKVCache(BaseCache):
    """A batch KV cache whose rows have their own lengths (drop-in for mlx-lm attention layers).

    Memory follows each row's own length. Keys and values live in a pool of ``block``-token blocks
    (``[H, slots, D]``); row i owns a list of blocks (its block table) covering its own length, so
    a 32K-token row beside seven chats holds 32K tokens of KV once, not eight times. Blocks of rows
    that leave or shrink return to a free list; the pool grows by at least an eighth (amortizing
    the copy) and is compacted when more than an eighth of it (at least ``_SLACK_BLOCKS``) is
    free. Attention still runs as one batched call: each step gathers the rows' blocks into the
    dense ``[B, H, n, D]`` keys/values the attention reads (n = the longest row, or the whole
    ``step``-rounded span, see below), a transient of one layer's size, freed after the layer.

    ``whole_buffer``: attention reads ``step``-rounded spans (its key length changes every
    ``step`` tokens) instead of the rows' longest length (every token). On by default where
    attention kernels are planned per shape (cuDNN's SDPA, which MLX's CUDA backend takes for
    multi-token queries such as a [B, k+1] verify): a key length that changes every token would
    be planned anew at every step. Elsewhere the masked tail would be wasted work.
    """

    step = 256  # the key-length granularity attention sees in whole_buffer mode
    block = 64  # the allocation unit of a row's KV
    # One row whose blocks are one run of the pool (a lone row after a compaction, or one that
    # grew alone) is read as a slice, without the gather's copy: see _read.
    slice_single_run = True
    # What one more attention call costs, in key positions read per row (length_groups.plan_groups);
    # 0: one call always. On the CPU attention's arithmetic dominates and a split can pay; on a GPU
    # reading short rows at a long row's span costs little and the split's extra launches cost
    # more: off on GPUs. None: the device's
    # (default_group_overhead), read when attention is planned.
    group_overhead: int | None = None

    def __init__(self, whole_buffer: bool | None = None, shared: StepArrays | None = None) -> None:
        self.whole_buffer = _plans_attention_per_shape() if whole_buffer is None else whole_buffer
        self._shared = StepArrays() if shared is None else shared
        self._pool_k: mx.array | None = None  # [H, blocks * block, Dk]; block 0 stays zero
        self._pool_v: mx.array | None = None
        self._free: list[int] = []  # free block ids, popped from the end
        self._tables: list[list[int]] = []  # per row: its block ids, in position order
        self._index = mx.zeros((0, 1), dtype=mx.int32)  # see _sync_table
        self._runs: list[int | None] = []  # per row: the first slot of its blocks when they are one run
        self._run: int | None = None  # the same for a lone row
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
        return self._pool_k is None

    @property
    def capacity(self) -> int:
        """The ``step``-rounded span of the longest row (what whole-buffer attention reads)."""
        return 0 if self._pool_k is None or not self._lengths else _round_up(self.size(), self.step)

    @property
    def keys(self) -> mx.array | None:
        """The rows' keys as one dense [B, H, capacity, Dk] array (a copy; for inspection)."""
        return None if self._pool_k is None or self._pool_v is None else gather_rows(self._pool_k, self._pool_v, self._positions(self.capacity))[0]

    @property
    def values(self) -> mx.array | None:
        return None if self._pool_k is None or self._pool_v is None else gather_rows(self._pool_k, self._pool_v, self._positions(self.capacity))[1]

    @property  # type: ignore[misc]  # read-only: mlx-lm's has a setter
    def state(self):
        return self._pool_k, self._pool_v, self.offset

    @property
    def nbytes(self) -> int:
        """Bytes held (the pool, free blocks included)."""
        return 0 if self._pool_k is None or self._pool_v is None else self._pool_k.nbytes + self._pool_v.nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks the rows own."""
        if self._pool_k is None or self._pool_v is None:
            return 0
        per_slot = (self._pool_k.nbytes + self._pool_v.nbytes) // self._pool_k.shape[1]
        return per_slot * self.block * sum(len(t) for t in self._tables)

    # -- positions ----------------------------------------------------------------------------

    def _set_lengths(self, lengths: list[int], shift: list[int] | None = None) -> None:
        self._lengths = list(lengths)
        if shift is not None:
            self._shift = list(shift)
        self._slots = self._ints(self._lengths)
        if any(self._shift):
            self.offset = self._ints([n + s for n, s in zip(self._lengths, self._shift)])
        else:
            self.offset = self._slots

    def _ints(self, values: list[int]) -> mx.array:
        key = ("ints", *values)
        return self._shared.get(key, lambda: mx.array(values, dtype=mx.int32))

    def _visible(self, needed: int) -> int:
        """How many key positions attention reads once ``needed`` are in use."""
        return _round_up(needed, self.step) if self.whole_buffer else needed

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported")
        # Query q of row i sits at position lengths[i] + q and sees the keys at positions <= its own.
        q_pos = self._slots[:, None] + mx.arange(N)
        k_pos = mx.arange(self._visible(self.size() + N))
        return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]

    # -- blocks -------------------------------------------------------------------------------

    def _sync_table(self) -> None:
        """Rebuild the slot index of every row's positions (only when some row's blocks change:
        at most once per ``block`` tokens per row), so a step reads and writes with one index
        op each instead of rebuilding it per layer and per step."""
        self._index, self._runs = self._shared.get(("index", *map(tuple, self._tables)), self._make_index)
        self._run = self._runs[0] if len(self._runs) == 1 else None

    def _make_index(self) -> tuple[mx.array, list[int | None]]:
        width = max((len(t) for t in self._tables), default=0) or 1
        table = mx.array([t + [0] * (width - len(t)) for t in self._tables] or [[0]], dtype=mx.int32)
        # [i, p]: the pool slot of row i's position p (past its blocks: the zero block)
        index = (table[:, :, None] * self.block + mx.arange(self.block, dtype=mx.int32)).reshape(table.shape[0], -1)
        runs = [t[0] * self.block if t and t == list(range(t[0], t[0] + len(t))) else None for t in self._tables]
        return index, runs

    def _grow(self, need: int, H: int, Dk: int, Dv: int, dtype: mx.Dtype) -> None:
        """Make at least ``need`` blocks free (zeros, never garbage: masked slots still enter the
        attention matmul, and 0 * NaN = NaN)."""
        if len(self._free) >= need:
            return
        have = 0 if self._pool_k is None else self._pool_k.shape[1] // self.block
        base = 0 if have else 1  # a new pool starts with the zero block that pads the tables
        add = max(need - len(self._free), have // 8) + base
        if self.whole_buffer:
            # Past the zero block, whole ``step`` spans: a lone row's blocks from block 1 (after a
            # compaction) are then read as one slice even where attention reads its rounded span.
            add += -(have + add - 1) % (self.step // self.block)
        new_k = mx.zeros((H, add * self.block, Dk), dtype)
        new_v = mx.zeros((H, add * self.block, Dv), dtype)
        if self._pool_k is None or self._pool_v is None:
            self._pool_k, self._pool_v = new_k, new_v
        else:
            self._pool_k = mx.concatenate([self._pool_k, new_k], axis=1)
            self._pool_v = mx.concatenate([self._pool_v, new_v], axis=1)
        self._release(list(range(have + base, have + add)))

    def _reserve(self, ends: list[int], H: int, Dk: int, Dv: int, dtype: mx.Dtype) -> list[int]:
        """Give row i blocks up to position ends[i]; the newly taken block ids."""
        wants = [-(-e // self.block) - len(t) for e, t in zip(ends, self._tables)]
        need = sum(w for w in wants if w > 0)
        if not need:
            return []
        if self._run is not None and self._tables[0][-1] + 1 != (self._free[-1] if self._free else -1):
            # A lone row read as a slice would lose its single run: pack it at the pool's start
            # (one copy of its KV), so that it grows at the end, as one run.
            self._compact(force=True)
        self._grow(need, H, Dk, Dv, dtype)
        taken = []
        for t, w in zip(self._tables, wants):
            for _ in range(w):
                t.append(self._free.pop())
                taken.append(t[-1])
        self._sync_table()
        return taken

    def _release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
        self._free.sort(reverse=True)

    def _positions(self, n: int) -> mx.array:
        """[B, n]: the pool slots of positions 0..n-1 of every row (past a row's blocks: the zero
        block)."""
        idx = self._index
        if n == idx.shape[1]:
            return idx
        if n > idx.shape[1]:
            return self._shared.get(("read", id(idx), n), lambda: mx.pad(idx, [(0, 0), (0, n - idx.shape[1])]), idx)
        return self._shared.get(("read", id(idx), n), lambda: idx[:, :n], idx)

    def _zero(self, blocks: list[int]) -> None:
        if not blocks:
            return
        idx = self._shared.get(
            ("zero", *blocks),
            lambda: (mx.array(blocks, dtype=mx.int32)[:, None] * self.block + mx.arange(self.block)).reshape(-1),
        )
        assert self._pool_k is not None and self._pool_v is not None  # blocks were just reserved
        H, _, Dk = self._pool_k.shape
        self._pool_k[:, idx] = mx.zeros((H, idx.size, Dk), self._pool_k.dtype)
        self._pool_v[:, idx] = mx.zeros((H, idx.size, self._pool_v.shape[2]), self._pool_v.dtype)

    def _compact(self, force: bool = False) -> None:
        """Give free blocks back when they are more than an eighth of the pool (what admission
        counts as the pool's slack), or when ``force``d."""
        if self._pool_k is None or self._pool_v is None:
            return
        used = sum(len(t) for t in self._tables)
        total = self._pool_k.shape[1] // self.block - 1
        if not force and total - used <= max(_SLACK_BLOCKS, used // 8):
            return
        order = [b for t in self._tables for b in t]
        idx = (mx.array([0] + order, dtype=mx.int32)[:, None] * self.block + mx.arange(self.block)).reshape(-1)
        self._pool_k, self._pool_v = self._pool_k[:, idx], self._pool_v[:, idx]
        nxt = 1
        for t in self._tables:
            t[:] = range(nxt, nxt + len(t))
            nxt += len(t)
        self._free = []
        pad = -used % (self.step // self.block) if self.whole_buffer else 0  # as _grow rounds
        if pad:
            H, _, Dk = self._pool_k.shape
            self._pool_k = mx.concatenate([self._pool_k, mx.zeros((H, pad * self.block, Dk), self._pool_k.dtype)], axis=1)
            self._pool_v = mx.concatenate([self._pool_v, mx.zeros((H, pad * self.block, self._pool_v.shape[2]), self._pool_v.dtype)], axis=1)
            self._release(list(range(nxt, nxt + pad)))
        self._sync_table()

    # -- the attention layer's interface ------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self._read(self._visible(self.write(keys, values)))

    def write(self, keys: mx.array, values: mx.array) -> int:
        """Store the step's keys/values ([B, H, S, D]) after each row's own; the longest row's new length."""
        B, H, S, Dk = keys.shape
        ends = [n + S for n in self._lengths]
        self._zero(self._reserve(ends, H, Dk, values.shape[3], keys.dtype))
        # In bounds by _reserve: MLX (0.32.4, CPU) does not bounds-check scatters, and an index
        # past the buffer corrupts the heap instead of raising.
        index, slots = self._index, self._slots
        idx = self._shared.get(
            ("write", id(index), id(slots), S),
            lambda: mx.take_along_axis(index, slots[:, None] + mx.arange(S, dtype=mx.int32), axis=1).reshape(1, B * S, 1),
            index, slots,
        )
        # put_along_axis (MLX's axis scatter) rather than an indexed assignment (its general scatter): on CUDA the
        # general one is the slower of the two at these sizes, paid per layer and step. A decode step's
        # [H, B, 1, D] -> [H, B, D] is a view; a verify's [H, B * S, D] a small copy.
        assert self._pool_k is not None and self._pool_v is not None  # reserved above
        self._pool_k = mx.put_along_axis(self._pool_k, idx, keys.transpose(1, 0, 2, 3).reshape(H, B * S, Dk), axis=1)
        self._pool_v = mx.put_along_axis(
            self._pool_v, idx, values.transpose(1, 0, 2, 3).reshape(H, B * S, values.shape[3]), axis=1
        )
        self._set_lengths(ends)
        return max(ends, default=0)

    def _read(self, n: int) -> tuple[mx.array, mx.array]:
        """The rows' keys and values at positions 0..n-1, as attention reads them."""
        assert self._pool_k is not None and self._pool_v is not None  # read after a write
        return self._slice(self._run, n) or self._gather(self._pool_k, self._pool_v, self._positions(n))

    def _slice(self, run: int | None, n: int) -> tuple[mx.array, mx.array] | None:
        """One row's positions 0..n-1 as a view of the pool, where its blocks are one run. Positions
        past the row's blocks read whatever the pool holds there: finite (zeros or keys of rows
        gone), and masked."""
        assert self._pool_k is not None and self._pool_v is not None  # read after a write
        if not self.slice_single_run or run is None or run + n > self._pool_k.shape[1]:
            return None
        return self._pool_k[None, :, run : run + n], self._pool_v[None, :, run : run + n]

    _gather = staticmethod(gather_rows)  # [B, H, n, D] keys and values: each row's run of a head contiguous

    def groups(self, S: int) -> tuple[list[RowGroup], mx.array] | None:
        """How attention should read the rows once each holds S more tokens: (a group per call,
        the permutation that puts the calls' concatenated outputs back in row order), or None for
        one call over every row (length_groups.plan_groups; the same for every layer of the
        batch, so planned once per step)."""
        overhead = default_group_overhead() if self.group_overhead is None else self.group_overhead
        if len(self._lengths) < 2 or not overhead:
            return None
        spans = [self._visible(n + S) for n in self._lengths]
        return self._shared.get(("groups", overhead, *spans), lambda: _plan(spans, overhead))

    def read_rows(self, group: RowGroup) -> tuple[mx.array, mx.array]:
        """The group's keys and values at positions 0..span-1 ([rows, H, span, D])."""
        if len(group.rows) == 1 and (view := self._slice(self._runs[group.rows[0]], group.span)):
            return view
        idx = self._positions(group.span)
        rows = self._shared.get(("rows", id(idx), id(group.index)), lambda: idx[group.index], idx, group.index)
        assert self._pool_k is not None and self._pool_v is not None  # read after a write
        return self._gather(self._pool_k, self._pool_v, rows)

    # -- rows -----------------------------------------------------------------------------------

    def trim_rows(self, counts: list[int]) -> None:
        """Forget the last counts[i] tokens of row i (per-row rollback; blocks stay with the row
        until it shrinks past them at the next ``filter``)."""
        self._set_lengths([max(0, n - c) for n, c in zip(self._lengths, counts)])

    def skip_rows(self, counts: list[int]) -> None:
        """Advance row i's positions by counts[i] without storing keys for them: the next token
        of the row is rotated as if the skipped ones were there (the MTP head resuming after
        plain decode steps leaves such a gap instead of catching up on every skipped pair)."""
        if any(counts):
            self._set_lengths(self._lengths, [s + c for s, c in zip(self._shift, counts)])

    def filter(self, keep: list[int]) -> None:
        kept = set(keep)
        for i, t in enumerate(self._tables):
            if i not in kept:
                self._release(t)
        self._tables = [self._tables[i] for i in keep]
        for t, n in zip(self._tables, (self._lengths[i] for i in keep)):
            own = -(-n // self.block)  # blocks past a row's length (rolled-back drafts) go back
            if len(t) > own:
                self._release(t[own:])
                del t[own:]
        self._set_lengths([self._lengths[i] for i in keep], [self._shift[i] for i in keep])
        if not keep:
            self._pool_k = self._pool_v = None
            self._free, self._tables = [], []
            self._sync_table()
            return
        self._sync_table()
        # A lone row is read as a slice when its blocks are one run from block 1 (see _read).
        lone = len(self._tables) == 1 and self._tables[0] and self._tables[0][0] != 1
        self._compact(force=bool(lone and self.slice_single_run))

    def add_row(self, cache: KVCache, shift: int = 0) -> None:
        """Append a batch-1 single-sequence cache as a new row; ``shift``: positions the row's next
        token sits past its keys (a sparse prefill)."""
        n = cache.offset if cache.keys is not None else 0
        self._tables.append([])
        self._set_lengths(self._lengths + [0], self._shift + [shift])
        if n:
            assert cache.keys is not None and cache.values is not None  # n > 0: the cache holds keys
            k, v = cache.keys[..., :n, :], cache.values[..., :n, :]
            _, H, _, Dk = k.shape
            self._reserve([0] * (self.batch_size - 1) + [n], H, Dk, v.shape[3], k.dtype)
            blocks = mx.array(self._tables[-1], dtype=mx.int32)
            idx = (blocks[:, None] * self.block + mx.arange(self.block)).reshape(-1)
            pad = [(0, 0), (0, 0), (0, idx.size - n), (0, 0)]  # the last block's tail: zeros
            assert self._pool_k is not None and self._pool_v is not None  # reserved above
            self._pool_k[:, idx] = mx.pad(k, pad)[0]
            self._pool_v[:, idx] = mx.pad(v, pad)[0]
            self._set_lengths(self._lengths[:-1] + [n])
        else:
            self._sync_table()

    def extract(self, i: int, shift: int = 0) -> KVCache:
        """Row i as a single-sequence ``KVCache`` (e.g. to keep it as a prefix cache); ``shift``: the row's position shift
        its owner re-applies when it restores the cache (a media row's M-RoPE delta)."""
        if self._shift[i] != shift:
            raise ValueError("a row with skipped positions has no single-sequence form")
        c = KVCache()
        n = self._lengths[i]
        if self._pool_k is not None and self._pool_v is not None and n:
            pos = mx.arange(n, dtype=mx.int32)
            blk = mx.array(self._tables[i], dtype=mx.int32)[pos // self.block]
            idx = blk * self.block + pos % self.block
            c.keys = mx.contiguous(self._pool_k[:, idx][None])
            c.values = mx.contiguous(self._pool_v[:, idx][None])
            c.offset = n
        return c

    def checkpoint(self) -> tuple:
        """Everything needed to ``restore`` this cache later (benchmarks rewind with it)."""
        return (self._pool_k, self._pool_v, list(self._free), [list(t) for t in self._tables],
                self.lengths, list(self._shift))

    def restore(self, saved: tuple) -> None:
        self._pool_k, self._pool_v, free, tables, lengths, shift = saved
        self._free, self._tables = list(free), [list(t) for t in tables]
        self._sync_table()
        self._set_lengths(lengths, shift)


_SLACK_BLOCKS = 8  # free blocks a pool may keep without compacting


def _gated_delta_zero_state(layer: nn.Module, dtype: mx.Dtype) -> list[mx.array]:
    """What a GatedDeltaNet starts from when its cache is empty (qwen3_5/qwen3_next layout)."""
    lin = layer.linear_attn
    conv = mx.zeros((1, lin.conv_kernel_size - 1, lin.conv_dim), dtype=dtype)
    return [conv, zero_state(lin, 1)]


class BatchCache:
    """Per-layer caches of the running decode batch, rows in the batch's row order."""

    def __init__(self, model: nn.Module, whole_buffer: bool | None = None) -> None:
        self._model = model
        single = model.make_cache()
        for c in single:
            if type(c) not in (ArraysCache, KVCache):
                raise TypeError(f"no batched form for cache type {type(c).__name__}")
        shared = StepArrays()
        self.layers: list[Any] = [
            ArraysCache(size=len(c.cache)) if isinstance(c, ArraysCache) else RaggedKVCache(whole_buffer, shared)
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

    def rollback(self, captured: list[Captured], keep: list[int], fed: int) -> None:
        """Row i keeps the first keep[i] of the ``fed`` tokens of the last captured forward
        (``backbone.backbone_forward(..., capture=True)``): attention rows are trimmed, gated-delta
        rows take their captured state."""
        rollback_rows(self.layers, captured, keep, fed)

    def state(self) -> list[Any]:
        return [c.state for c in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)
