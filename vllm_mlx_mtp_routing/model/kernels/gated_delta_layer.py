"""The gated-delta layer's conv, gates, head norms and recurrence on MLX's CUDA backend: one kernel a decode step.

Between its input projections and its gated output norm, the layer runs, per position: the depthwise causal conv and
its SiLU, the RMS norm of each q and k head and their scales, the decay ``g`` and ``beta`` from the gate projections,
and one recurrence step. As MLX ops (with the conv and the recurrence as this package's kernels) that is eight
launches a layer however the step is compiled, and a small batch's decode step on a GPU is bound by its launches
(docs/design-notes.md). Here one thread block per (row, value head, 4 value rows) computes them all: each warp
convolves and normalizes its head's q and k itself (a warp spans the key dimension, so a head's norm is a shuffle
reduction), then runs recurrence.py's arithmetic. That kernel runs its positions in turn, which a prompt chunk of
thousands of positions would pay: a long call computes every position's inputs in parallel first (the same code, so
the same values) and then runs recurrence.py's kernel.

Every quantity rounds to the model's dtype where mlx-lm's ops round it, so the layer agrees with mlx-lm's to rounding
(benchmarks/gpu/layer_check.py). Exactness within the text path: a position's arithmetic is the same whatever the
number of positions in the call, its path or the rows in the batch, and every CUDA path of the layer (a decode step, a
prompt chunk, the MTP verify with its states kept) runs these kernels; so a prompt in any chunks, a row alone or
batched, and a verify against plain steps see bitwise the same values, as with the recurrence kernel alone (the
layer_check job checks each).

The next conv window (the last K - 1 positions of [conv state; input]) comes out too. A mask (mlx-lm's padded batch
prefill) runs the ops.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .device import kind
from .recurrence import STEP, gated_delta_fused

# What both kernels compute of a position, the same text in each (so the same arithmetic): the window [conv state; x]
# read where it lies (x and the gates are column slices of the fused projection), the conv (causal_conv.py's order)
# and mlx-lm's SiLU, x * sigmoid(x), each rounded to the model's dtype where mlx-lm's ops round it.
_POSITION = """
    constexpr int P = K - 1;
    constexpr int n_per_t = Dk / 32;
    constexpr int key_dim = Hk * Dk;
    #define X(i, c) static_cast<float>((i) < P \\
        ? conv_state[b_idx * conv_state_strides[0] + (size_t)(i) * conv_state_strides[1] \\
                     + (size_t)(c) * conv_state_strides[2]] \\
        : x[b_idx * x_strides[0] + (size_t)((i) - P) * x_strides[1] + (size_t)(c) * x_strides[2]])
    auto rnd = [](float v) { return static_cast<float>(static_cast<InT>(v)); };  // what a tensor of InT holds
    auto conv_silu = [&](int t, int c) {
        float acc = 0.0f;
        #pragma unroll
        for (int j = 0; j < K; ++j)
            acc += X(t + j, c) * static_cast<float>(w[(size_t)c * w_strides[0] + (size_t)j * w_strides[1]]);
        const float u = rnd(acc);
        return rnd(u * rnd(1.0f / (1.0f + expf(-u))));
    };
    const int cq = hk_idx * Dk + n_per_t * dk_idx;  // this lane's first q channel; its k channels are key_dim on
    const float q_scale = rnd(1.0f / Dk);  // mlx-lm's (Dk ** -0.5) ** 2 and Dk ** -0.5, scalars of the model's dtype
    const float k_scale = rnd(1.0f / sqrtf((float)Dk));
    // position t's q and k of this lane (its head's RMS norm is the warp's sum), rounded as mlx-lm's tensors
    auto qk_at = [&](int t, float* q, float* k) {
      float qss = 0.0f, kss = 0.0f;
      for (int i = 0; i < n_per_t; ++i) {
        q[i] = conv_silu(t, cq + i);
        k[i] = conv_silu(t, key_dim + cq + i);
        qss += q[i] * q[i];
        kss += k[i] * k[i];
      }
      for (int off = 16; off > 0; off /= 2) {
        qss += __shfl_xor_sync(0xffffffff, qss, off);
        kss += __shfl_xor_sync(0xffffffff, kss, off);
      }
      const float qn = rsqrtf(qss / Dk + 1e-6f);
      const float kn = rsqrtf(kss / Dk + 1e-6f);
      for (int i = 0; i < n_per_t; ++i) {
        q[i] = rnd(rnd(q[i] * qn) * q_scale);
        k[i] = rnd(rnd(k[i] * kn) * k_scale);
      }
    };
    // value head hv's decay (float32, as mlx-lm's compute_g) and beta at position t
    auto gates_at = [&](int t, int hv, float& decay, float& beta) {
      const float A = expf(static_cast<float>(A_log[hv * A_log_strides[0]]));
      const float ab = rnd(static_cast<float>(a[b_idx * a_strides[0] + (size_t)t * a_strides[1] + hv * a_strides[2]])
                           + static_cast<float>(dt_bias[hv * dt_bias_strides[0]]));
      const float softplus = rnd(ab > 0.0f ? ab + log1pf(expf(-ab)) : log1pf(expf(ab)));  // logaddexp(ab, 0)
      decay = expf(-A * softplus);
      const float b_t = static_cast<float>(b[b_idx * b_strides[0] + (size_t)t * b_strides[1] + hv * b_strides[2]]);
      beta = rnd(1.0f / (1.0f + expf(-b_t)));
    };
"""

# One kernel for a call: a block per (row, value head, 4 value rows), positions in turn, recurrence.py's step.
_LAYER_SOURCE = """
    const int B = x_shape[0];  // not template constants: one compile serves every batch size and length
    const int T = x_shape[1];
    const int C = x_shape[2];
    const int n = blockIdx.z;
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
    const int dk_idx = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    if (b_idx >= B || dv_idx >= Dv) return;
""" + _POSITION + """
    const int cv = 2 * key_dim + hv_idx * Dv + dv_idx;
    float state[n_per_t];
    const size_t s_in =
        b_idx * state_in_strides[0] + hv_idx * state_in_strides[1] + (size_t)dv_idx * state_in_strides[2];
    for (int i = 0; i < n_per_t; ++i) {
      state[i] = static_cast<float>(state_in[s_in + (size_t)(n_per_t * dk_idx + i) * state_in_strides[3]]);
    }
    InT* y_ = y + (size_t)b_idx * T * Hv * Dv + hv_idx * Dv;
    for (int t = 0; t < T; ++t) {
      float q[n_per_t], k[n_per_t], decay, beta;
      qk_at(t, q, k);
      const float v = conv_silu(t, cv);
      gates_at(t, hv_idx, decay, beta);
      #define Q_AT(i) q[i]
      #define K_AT(i) k[i]
      #define V_AT v
      #define BETA_AT beta
""" + STEP + """
      #undef Q_AT
      #undef K_AT
      #undef V_AT
      #undef BETA_AT
      if (dk_idx == 0) y_[dv_idx] = static_cast<InT>(out);
      if (Capture) {
        StT* c_state = states + ((((size_t)b_idx * T + t) * Hv + hv_idx) * Dv + dv_idx) * Dk;
        for (int i = 0; i < n_per_t; ++i) c_state[n_per_t * dk_idx + i] = static_cast<StT>(state[i]);
      }
      y_ += Hv * Dv;
    }
    if (!Capture) {
      StT* o_state = states + (((size_t)n * Dv + dv_idx) * Dk);
      for (int i = 0; i < n_per_t; ++i) o_state[n_per_t * dk_idx + i] = static_cast<StT>(state[i]);
    }
    // the next conv window: a key head's q and k channels by the first block of its first value head, a value channel
    // by its warp's first lane
    InT* win = window + (size_t)b_idx * P * C;
    const bool qk_writer = hv_idx % (Hv / Hk) == 0 && blockIdx.y == 0 && threadIdx.y == 0;
    for (int p = 0; p < P; ++p) {
      if (qk_writer) {
        for (int i = 0; i < n_per_t; ++i) {
          win[(size_t)p * C + cq + i] = static_cast<InT>(X(T + p, cq + i));
          win[(size_t)p * C + key_dim + cq + i] = static_cast<InT>(X(T + p, key_dim + cq + i));
        }
      }
      if (dk_idx == 0) win[(size_t)p * C + cv] = static_cast<InT>(X(T + p, cv));
    }
    #undef X
"""

# A long call's positions in parallel: a warp per (row, position, key head), four to a block, writes its q and k, and
# the v, decay and beta of the value heads that read them; recurrence.py's kernel then runs the positions. Same values
# as the one kernel.
_INPUTS_SOURCE = """
    const int B = x_shape[0];
    const int T = x_shape[1];
    const int bt = blockIdx.x;
    const int b_idx = bt / T;
    const int t = bt % T;
    const int hk_idx = blockIdx.y * blockDim.y + threadIdx.y;
    const int dk_idx = threadIdx.x;
    if (b_idx >= B || hk_idx >= Hk) return;
""" + _POSITION + """
    float q[n_per_t], k[n_per_t];
    qk_at(t, q, k);
    const size_t at = ((size_t)bt * Hk + hk_idx) * Dk + n_per_t * dk_idx;
    for (int i = 0; i < n_per_t; ++i) {
      q_out[at + i] = static_cast<InT>(q[i]);
      k_out[at + i] = static_cast<InT>(k[i]);
    }
    constexpr int per_key = Hv / Hk;
    for (int j = dk_idx; j < per_key * Dv; j += 32) {
      const int hv = hk_idx * per_key + j / Dv;
      v_out[((size_t)bt * Hv + hv) * Dv + j % Dv] = static_cast<InT>(conv_silu(t, 2 * key_dim + hv * Dv + j % Dv));
    }
    if (dk_idx < per_key) {
      const int hv = hk_idx * per_key + dk_idx;
      float decay, beta;
      gates_at(t, hv, decay, beta);
      g_out[(size_t)bt * Hv + hv] = decay;
      beta_out[(size_t)bt * Hv + hv] = static_cast<InT>(beta);
    }
    #undef X
"""

# Calls of at most this many positions (decode steps, MTP verifies) run as one kernel; longer ones (prompt chunks)
# compute their inputs in parallel first, since the one kernel runs its positions in turn.
ONE_KERNEL_POSITIONS = 16

# Where the layer runs this kernel: CUDA (benchmarks/decode_variants.py --options fused_layer measures it against the
# ops; benchmarks/gpu/layer_check.py its agreement and exactness).
fused_layer_devices: set[str] = {"cuda"}


_INPUTS = ["x", "conv_state", "w", "a", "b", "A_log", "dt_bias"]


@cache
def _layer_kernel() -> Any:
    return mx.fast.cuda_kernel(name="gated_delta_layer", input_names=_INPUTS + ["state_in"],
                               output_names=["y", "states", "window"], source=_LAYER_SOURCE,
                               ensure_row_contiguous=False)


@cache
def _inputs_kernel() -> Any:
    return mx.fast.cuda_kernel(name="gated_delta_inputs", input_names=_INPUTS,
                               output_names=["q_out", "k_out", "v_out", "g_out", "beta_out"], source=_INPUTS_SOURCE,
                               ensure_row_contiguous=False)


def runs(lin: nn.Module, qkv: mx.array, conv_state: mx.array, mask: mx.array | None) -> bool:
    """Whether ``gated_delta_layer`` serves this call of gated-delta layer ``lin``: a CUDA device (the kernel's only
    backend) that is on (``fused_layer_devices``), no mask, a bias-free depthwise conv, key heads a multiple of 32 wide,
    every input in the weights' dtype."""
    conv = lin.conv1d
    w = getattr(conv, "weight", None)
    device = kind()
    return (
        device == "cuda"
        and device in fused_layer_devices
        and mask is None
        and not lin.training
        and w is not None
        and "bias" not in conv
        and conv.padding == 0
        and w.shape == (lin.conv_dim, w.shape[1], 1)
        and qkv.ndim == 3
        and qkv.shape[2] == lin.conv_dim
        and conv_state.shape == (qkv.shape[0], w.shape[1] - 1, lin.conv_dim)
        and qkv.dtype == conv_state.dtype == w.dtype
        and lin.head_k_dim % 32 == 0
        and lin.head_v_dim % 4 == 0
        and lin.num_v_heads % lin.num_k_heads == 0
        and lin.num_v_heads // lin.num_k_heads <= 32  # a key head's warp writes its value heads' gates, a lane each
    )


def gated_delta_layer(
    lin: nn.Module, qkv: mx.array, conv_state: mx.array, a: mx.array, b: mx.array, state: mx.array,
    capture: bool = False, one_kernel: bool | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Gated-delta layer ``lin`` from its projections (see ``runs``): qkv [B, T, conv_dim], the gate projections a, b
    [B, T, Hv], its conv state [B, K - 1, conv_dim] and recurrent state [B, Hv, Dv, Dk] -> (y [B, T, Hv, Dv] before
    the gated norm, the final recurrent state or with ``capture`` the state after every position [B, T, Hv, Dv, Dk],
    the next conv state). ``one_kernel``: None picks by the number of positions (``ONE_KERNEL_POSITIONS``)."""
    B, T, C = qkv.shape
    Hk, Hv, Dk, Dv = lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim
    K = lin.conv1d.weight.shape[1]
    inputs = [qkv, conv_state, lin.conv1d.weight, a, b, lin.A_log, lin.dt_bias]
    template: list[tuple[str, Any]] = [("InT", qkv.dtype), ("K", K), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)]
    if one_kernel if one_kernel is not None else T <= ONE_KERNEL_POSITIONS:
        y, states, window = _layer_kernel()(
            inputs=inputs + [state],
            template=template + [("StT", state.dtype), ("Capture", capture)],
            grid=(32, Dv, B * Hv),
            threadgroup=(32, 4, 1),
            output_shapes=[(B, T, Hv, Dv), (B, T, Hv, Dv, Dk) if capture else (B, Hv, Dv, Dk), (B, K - 1, C)],
            output_dtypes=[qkv.dtype, state.dtype, qkv.dtype],
        )
        return y, states, window
    q, k, v, g, beta = _inputs_kernel()(
        inputs=inputs,
        template=template,
        grid=(32 * B * T, (Hk + 3) // 4 * 4, 1),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hk, Dk), (B, T, Hk, Dk), (B, T, Hv, Dv), (B, T, Hv), (B, T, Hv)],
        output_dtypes=[qkv.dtype, qkv.dtype, qkv.dtype, mx.float32, qkv.dtype],
    )
    y, states = gated_delta_fused(q, k, v, g, beta, state, capture=capture)
    window = mx.concatenate([conv_state, qkv], axis=1)[:, -(K - 1):] if T < K - 1 else qkv[:, -(K - 1):]
    return y, states, mx.contiguous(window)
