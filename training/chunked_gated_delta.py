"""Chunked (WY-form) gated delta rule for training, equal in exact arithmetic to mlx-lm's recurrence.

mlx-lm 0.31.3 runs the gated delta rule as a Python loop of one compiled step per token off Metal
(`gated_delta_ops`), so a training step on MLX's CUDA or CPU backend launches O(T) small kernels
per layer, forward and backward. Here a sequence is cut into chunks of C tokens; inside a chunk
the recurrence is solved in closed form (one triangular solve of size C, then matrix products),
and only the chunk-to-chunk state update stays sequential: T/C + C steps instead of T.

Per head, with state S (Dv x Dk), decay g_t, beta_t and unit keys:
    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,   y_t = S_t q_t
Inside a chunk starting from S_0, with gamma_t = prod_{s<=t} g_s:
    S_t = gamma_t S_0 + sum_{s<=t} (gamma_t / gamma_s) u_s k_s^T
    (I + A) U = diag(beta) (V - diag(gamma) K S_0^T),  A_ts = beta_t (gamma_t/gamma_s) k_t.k_s  (s < t)
    Y = diag(gamma) Q S_0^T + (M o Q K^T) U,           M_ts = gamma_t / gamma_s  (s <= t)
    S_C = gamma_C S_0 + U^T diag(gamma_C / gamma) K
Serving keeps mlx-lm's own recurrence; tests/test_training.py checks both agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn


def _forward_substitute(A: mx.array, R: mx.array) -> mx.array:
    """Solve (I + A) X = R for X, A strictly lower triangular (C x C) over the last two axes.

    Jacobi sweeps X <- R - A X: after sweep n rows 0..n are final and later rows never feed back
    into them, so C - 1 sweeps give forward substitution's result; every sweep has the same shapes,
    which keeps the number of distinct kernels a backend has to compile small.
    """
    X = R
    for _ in range(A.shape[-1] - 1):
        X = R - A @ X
    return X


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    chunk: int = 16,
) -> tuple[mx.array, mx.array]:
    """Same inputs and outputs as mlx_lm.models.gated_delta.gated_delta_update (no mask)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    in_dtype = q.dtype
    if (rep := Hv // Hk) > 1:
        q = mx.repeat(q, rep, -2)
        k = mx.repeat(k, rep, -2)
    beta = mx.sigmoid(b.astype(mx.float32))
    log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus((a + dt_bias).astype(mx.float32))

    pad = (-T) % chunk
    if pad:  # padded steps have k = v = 0, g = 1: the state passes through unchanged
        widths3 = [(0, 0), (0, pad), (0, 0)]
        widths4 = widths3 + [(0, 0)]
        q, k, v = (mx.pad(t, widths4) for t in (q, k, v))
        beta, log_g = mx.pad(beta, widths3), mx.pad(log_g, widths3)
    n = (T + pad) // chunk

    def blocks(t):  # [B, T, H, ...] -> [B, H, n, C, ...]
        t = t.astype(mx.float32).reshape(B, n, chunk, Hv, *t.shape[3:])
        return mx.moveaxis(t, 3, 1)

    q, k, v, beta, log_g = blocks(q), blocks(k), blocks(v), blocks(beta), blocks(log_g)
    cum = mx.cumsum(log_g, axis=-1)  # log gamma_t inside the chunk
    diff = cum[..., :, None] - cum[..., None, :]  # log(gamma_t / gamma_s)
    idx = mx.arange(chunk)
    strict = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    decay_strict = mx.where(strict, mx.exp(mx.where(strict, diff, 0.0)), 0.0)
    decay_incl = mx.where(incl, mx.exp(mx.where(incl, diff, 0.0)), 0.0)

    kt = k.swapaxes(-1, -2)
    A = beta[..., None] * (k @ kt) * decay_strict
    gamma = mx.exp(cum)[..., None]
    R = mx.concatenate([beta[..., None] * v, beta[..., None] * gamma * k], axis=-1)
    X = _forward_substitute(A, R)
    U0, W = X[..., :Dv], X[..., Dv:]
    P = (q @ kt) * decay_incl
    qg = q * gamma
    k_end = k * mx.exp(cum[..., -1:] - cum)[..., None]
    g_end = mx.exp(cum[..., -1])[..., None, None]

    S = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32) if state is None else state.astype(mx.float32)
    ys = []
    for c in range(n):
        St = S.swapaxes(-1, -2)
        U = U0[:, :, c] - W[:, :, c] @ St
        ys.append(qg[:, :, c] @ St + P[:, :, c] @ U)
        S = g_end[:, :, c] * S + U.swapaxes(-1, -2) @ k_end[:, :, c]
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * chunk, Dv)[:, :, :T]
    return mx.moveaxis(y, 1, 2).astype(in_dtype), S


def patch_mlx_lm_qwen3_5(chunk: int = 16):
    """Route mlx-lm qwen3_5's GatedDeltaNet through the chunked form when no cache/mask is used.

    Reaches into mlx_lm 0.31.3: qwen3_5.py calls the module-level name `gated_delta_update`.
    Returns a function that undoes the patch.
    """
    from mlx_lm.models import qwen3_5

    original = qwen3_5.gated_delta_update

    def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, use_kernel=True):
        if mask is not None:
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel)
        return gated_delta_chunked(q, k, v, a, b, A_log, dt_bias, state, chunk)

    qwen3_5.gated_delta_update = update

    def undo():
        qwen3_5.gated_delta_update = original

    return undo


@contextlib.contextmanager
def chunked_recurrence(chunk: int) -> Iterator[None]:
    """Inside the block, mlx-lm qwen3_5's recurrence in the chunked form (training only); mlx-lm's own after it, also
    when the block raises, so a process that trains and then serves or tests runs the recurrence it serves with.
    ``chunk`` <= 0: unchanged."""
    undo = patch_mlx_lm_qwen3_5(chunk) if chunk > 0 else None
    try:
        yield
    finally:
        if undo is not None:
            undo()
