"""16-bit MoE experts on MLX's CPU backend, whose GatherMM multiplies float32 only (mlx 0.32.4:
"[GatherMM::eval] Currently only supports float32").

A bfloat16 or float16 MoE checkpoint would fail its first forward there (the host fails every request; the
plugin's start-up prefill calibration would stop the server). Its expert layers (mlx-lm's and mlx-vlm's
``SwitchLinear``, unquantized; quantized experts run GatherQMM, which takes 16 bits) are swapped here for a
subclass that multiplies in float32 on the CPU: a call that routes fewer (token, expert) pairs than the layer has
experts gathers just those experts' weights, a larger one converts the layer's whole expert stack for the call.
Nothing is converted ahead: weights stay as loaded, and the call's output keeps the input's dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .device import kind

_SIXTEEN_BITS = (mx.bfloat16, mx.float16)


def _float32_call(self: Any, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
    weight = self["weight"]
    if weight.dtype not in _SIXTEEN_BITS or kind() != "cpu":
        return super(type(self), self).__call__(x, indices, sorted_indices=sorted_indices)
    if indices.size < weight.shape[0]:
        # x [..., 1, I] against each pair's own expert [..., O, I]: the shapes gather_mm gives
        chosen = weight[indices].astype(mx.float32)
        y = x.astype(mx.float32) @ chosen.swapaxes(-1, -2)
    else:
        y = mx.gather_mm(x.astype(mx.float32), weight.astype(mx.float32).swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
    y = y.astype(x.dtype)
    if "bias" in self:
        y = y + mx.expand_dims(self["bias"][indices], -2)
    return y


@functools.cache
def _subclasses() -> dict[type, type]:
    """mlx-lm's and mlx-vlm's ``SwitchLinear`` (mlx-lm 0.31.3, mlx-vlm 0.7.10) -> their float32 subclasses; imported
    when first needed (a loaded model has imported both already)."""
    from mlx_lm.models.switch_layers import SwitchLinear as LMSwitchLinear
    from mlx_vlm.models.switch_layers import SwitchLinear as VLMSwitchLinear

    return {base: type(f"Float32{base.__name__}", (base,), {"__call__": _float32_call, "__module__": __name__})
            for base in (LMSwitchLinear, VLMSwitchLinear)}


def use_float32_experts(module: nn.Module) -> int:
    """On MLX's CPU backend, give every unquantized 16-bit expert layer under ``module`` the float32 call;
    how many changed (0 elsewhere, or with float32 or quantized experts)."""
    if kind() != "cpu":
        return 0
    n = 0
    for _, m in module.named_modules():
        sub = _subclasses().get(type(m))
        if sub is not None and m["weight"].dtype in _SIXTEEN_BITS:
            m.__class__ = sub
            n += 1
    return n
