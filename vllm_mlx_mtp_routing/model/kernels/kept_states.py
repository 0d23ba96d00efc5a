"""The MTP rollback's gated-delta part on MLX's CUDA backend: every layer's kept state and conv window in one kernel.

After a verify of S positions each row keeps the first n of them, so each gated-delta layer takes, per row, the
recurrent state after position n - 1 (of the S the verify kept) and the conv window ending there. As MLX ops that is
a select or a gather for the state and another gather for the window: two launches or more a layer, sixty or more a
step at the 35B-A3B shape, and a small batch's MTP step on a GPU is bound by its launches (docs/design-notes.md).
Here one launch copies them all, layer by layer (``blockIdx.z``), row by row (``blockIdx.y``), 16 bytes a thread: the
same bits the ops give. The window is read from the conv states before and after the verify, which cover the window
input when the verify's S positions are at most the K - 1 the conv keeps (one or two drafts at Qwen3.5's K = 4), so
the verify never builds that input. Elsewhere (CPU, Metal) the ops stay (backbone.rollback_rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any, cast

import mlx.core as mx

from .device import kind

# Where the rollback runs this kernel (benchmarks/decode_variants.py --options kept_states measures it against the
# ops; benchmarks/gpu/layer_check.py checks it copies their bits).
kept_states_devices: set[str] = {"cuda"}

# Layers per launch: each adds five pointers to the kernel's parameters, which CUDA caps at 4 KB.
MAX_LAYERS = 32

_BODY = """
    const int b = blockIdx.y;
    const int l = blockIdx.z;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)(E + NK * CV)) return;
    const int t = last[b];  // the last position the row keeps
    const uint4 *kept, *before, *after;
    uint4 *state, *window;
    switch (l) {
CASES
      default: return;
    }
    if (i < E) {  // the state after position t, of the S kept
      state[(size_t)b * E + i] = kept[((size_t)b * S + t) * E + i];
    } else {  // the conv window ending at t: positions t + 1 .. t + NK of [state before; inputs] = [before; after[NK - S:]]
      const size_t j = i - E;
      const int p = t + 1 + (int)(j / CV);
      const size_t c = j % CV;
      window[(size_t)b * NK * CV + j] = p < NK ? before[((size_t)b * NK + p) * CV + c]
                                               : after[((size_t)b * NK + p - S) * CV + c];
    }
"""

_CASE = """      case {l}:
        kept = reinterpret_cast<const uint4*>(kept{l});
        before = reinterpret_cast<const uint4*>(before{l});
        after = reinterpret_cast<const uint4*>(after{l});
        state = reinterpret_cast<uint4*>(state{l});
        window = reinterpret_cast<uint4*>(window{l});
        break;"""


@cache
def _kernel(layers: int) -> Any:
    cases = "\n".join(_CASE.format(l=n) for n in range(layers))
    return mx.fast.cuda_kernel(
        name=f"kept_states_{layers}",
        input_names=["last", *(f"{name}{n}" for name in ("kept", "before", "after") for n in range(layers))],
        output_names=[f"state{n}" for n in range(layers)] + [f"window{n}" for n in range(layers)],
        source=_BODY.replace("CASES", cases),
    )


def runs(kept: list[mx.array], before: Sequence[mx.array | None], after: Sequence[mx.array | None]) -> bool:
    """Whether ``take`` serves these layers: a CUDA device that is on (``kept_states_devices``), every layer's kept
    states [B, S, ...] alike, its conv states before and after [B, K - 1, C] alike with S <= K - 1, rows a whole
    number of 16 bytes."""
    device = kind()
    if device != "cuda" or device not in kept_states_devices or not kept or not len(kept) == len(before) == len(after):
        return False
    s, c = kept[0], before[0]
    if c is None or any(x is None for x in (*before, *after)):
        return False
    windows = cast("list[mx.array]", [*before, *after])
    return (
        s.ndim >= 3
        and c.ndim == 3
        and s.shape[0] == c.shape[0]
        and s.shape[1] <= c.shape[1]
        and all(x.shape == s.shape and x.dtype == s.dtype for x in kept)
        and all(x.shape == c.shape and x.dtype == c.dtype for x in windows)
        and (s[0, 0].size * s.itemsize) % 16 == 0
        and (c.shape[2] * c.itemsize) % 16 == 0
    )


def take(kept: list[mx.array], before: list[mx.array], after: list[mx.array],
         last: mx.array) -> tuple[list[mx.array], list[mx.array]]:
    """Per layer, each row's kept state and conv window: ``kept`` [B, S, ...] the states after each of S positions,
    ``before`` and ``after`` [B, n_keep, C] the conv states before and after them, ``last`` [B] int32 the last
    position row b keeps -> (states [B, ...] with [b] = kept[b, last[b]], windows [B, n_keep, C] with [b] the n_keep
    positions of [before; inputs] from last[b] + 1). See ``runs`` for what it takes."""
    B, S = kept[0].shape[:2]
    n_keep, C = before[0].shape[1:]
    E = kept[0][0, 0].size * kept[0].itemsize // 16
    CV = C * before[0].itemsize // 16
    states: list[mx.array] = []
    windows: list[mx.array] = []
    for at in range(0, len(kept), MAX_LAYERS):
        part = slice(at, at + MAX_LAYERS)
        L = len(kept[part])
        outs = _kernel(L)(
            inputs=[last.astype(mx.int32), *kept[part], *before[part], *after[part]],
            template=[("S", S), ("NK", n_keep), ("E", E), ("CV", CV)],
            grid=(E + n_keep * CV, B, L),
            threadgroup=(256, 1, 1),
            output_shapes=[(B, *kept[0].shape[2:])] * L + [(B, n_keep, C)] * L,
            output_dtypes=[kept[0].dtype] * L + [before[0].dtype] * L,
        )
        states += outs[:L]
        windows += outs[L:]
    return states, windows
