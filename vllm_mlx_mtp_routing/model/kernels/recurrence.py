"""The gated-delta recurrence on MLX's CUDA backend: one fused kernel per call.

Off Metal, mlx-lm 0.31.3 runs the recurrence as a Python loop of a compiled single step, a few
launches per position and layer: a prefill pays them per token whatever the batch size, and a
2-token verify pays the loop twice.
The kernel below is mlx-lm's Metal kernel ported to CUDA: one thread block per (row, value head,
4 value rows), a warp over the key dimension, the positions looped inside the kernel with the
state in registers. Each position runs the same arithmetic whatever the number of positions in
the call or of rows in the batch, so a prompt prefilled in chunks, a prefix restored from a
snapshot, a verify of [token, drafts] and a row decoded alone or in a batch all see bitwise the
same recurrence: the exactness the text engine guarantees carries over.

``capture=True`` also returns the state after every position (the verify's rollback needs it).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

# One position's update of a warp's slice of the state, the same text in every kernel that runs the recurrence
# (gated_delta_layer.py's too), so that every path computes a position alike. The kernel defines ``decay``, Q_AT(i) and
# K_AT(i) (its lane's i-th q and k element, as float), V_AT and BETA_AT; the step leaves the position's output in ``out``.
STEP = """
        float kv_mem = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {
          state[i] = state[i] * decay;
          kv_mem += state[i] * K_AT(i);
        }
        for (int off = 16; off > 0; off /= 2) kv_mem += __shfl_xor_sync(0xffffffff, kv_mem, off);
        const float delta = (V_AT - kv_mem) * BETA_AT;
        float out = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {
          state[i] = state[i] + K_AT(i) * delta;
          out += state[i] * Q_AT(i);
        }
        for (int off = 16; off > 0; off /= 2) out += __shfl_xor_sync(0xffffffff, out, off);
"""

_SOURCE = """
    const int B = q_shape[0];  // not a template constant: one compile serves every batch size
    const int T = q_shape[1];
    const int n = blockIdx.z * blockDim.z + threadIdx.z;
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
    constexpr int n_per_t = Dk / 32;
    const int dk_idx = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    if (b_idx >= B || dv_idx >= Dv) return;

    const InT* q_ = q + (size_t)b_idx * T * Hk * Dk + hk_idx * Dk;
    const InT* k_ = k + (size_t)b_idx * T * Hk * Dk + hk_idx * Dk;
    const InT* v_ = v + (size_t)b_idx * T * Hv * Dv + hv_idx * Dv;
    InT* y_ = y + (size_t)b_idx * T * Hv * Dv + hv_idx * Dv;
    const GT* g_ = g + (size_t)b_idx * T * Hv;
    const BT* beta_ = beta + (size_t)b_idx * T * Hv;
    const StT* i_state = state_in + ((size_t)n * Dv + dv_idx) * Dk;

    #define Q_AT(i) static_cast<float>(q_[n_per_t * dk_idx + (i)])
    #define K_AT(i) static_cast<float>(k_[n_per_t * dk_idx + (i)])
    #define V_AT static_cast<float>(v_[dv_idx])
    #define BETA_AT static_cast<float>(beta_[hv_idx])
    float state[n_per_t];
    for (int i = 0; i < n_per_t; ++i) {
      state[i] = static_cast<float>(i_state[n_per_t * dk_idx + i]);
    }
    for (int t = 0; t < T; ++t) {
      const bool live = LIVE;
      if (live) {
        const float decay = static_cast<float>(g_[hv_idx]);
""" + STEP + """
        if (dk_idx == 0) y_[dv_idx] = static_cast<InT>(out);
      } else if (dk_idx == 0) {
        y_[dv_idx] = static_cast<InT>(0.0f);
      }
      if (Capture) {
        StT* c_state = states + ((((size_t)b_idx * T + t) * Hv + hv_idx) * Dv + dv_idx) * Dk;
        for (int i = 0; i < n_per_t; ++i) c_state[n_per_t * dk_idx + i] = static_cast<StT>(state[i]);
      }
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y_ += Hv * Dv;
      g_ += Hv;
      beta_ += Hv;
    }
    if (!Capture) {
      StT* o_state = states + ((size_t)n * Dv + dv_idx) * Dk;
      for (int i = 0; i < n_per_t; ++i) o_state[n_per_t * dk_idx + i] = static_cast<StT>(state[i]);
    }
    #undef Q_AT
    #undef K_AT
    #undef V_AT
    #undef BETA_AT
"""


@cache
def _kernel(has_mask: bool):
    inputs = ["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if has_mask else [])
    return mx.fast.cuda_kernel(
        name="gated_delta_fused" + ("_mask" if has_mask else ""),
        input_names=inputs,
        output_names=["y", "states"],
        source=_SOURCE.replace("LIVE", "static_cast<bool>(mask[b_idx * T + t])" if has_mask else "true"),
    )


def gated_delta_fused(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
    capture: bool = False,
) -> tuple[mx.array, mx.array]:
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv] (scalar gating); state
    [B, Hv, Dv, Dk] -> (y [B, T, Hv, Dv], the final state, or with ``capture`` the state after
    every position [B, T, Hv, Dv, Dk])."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if g.ndim != 3 or Dk % 32:
        raise ValueError(f"fused gated delta needs scalar gating and Dk % 32 == 0, got g {g.shape}, Dk {Dk}")
    inputs = [q, k, v, g, beta, state] + ([mask] if mask is not None else [])
    y, states = _kernel(mask is not None)(
        inputs=inputs,
        template=[
            ("InT", q.dtype),
            ("GT", g.dtype),
            ("BT", beta.dtype),
            ("StT", state.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("Capture", capture),
        ],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), (B, T, Hv, Dv, Dk) if capture else state.shape],
        output_dtypes=[q.dtype, state.dtype],
    )
    return y, states
